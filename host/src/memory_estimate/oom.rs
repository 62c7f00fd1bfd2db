use anyhow::{bail, Result};
use std::sync::Mutex;

/// The advice of the last estimate, for an out-of-memory error at run time.
pub(super) static ADVICE: Mutex<Option<String>> = Mutex::new(None);

/// Whether an error message is a CUDA out-of-memory (libtorch's `CUDA out of memory`, the CUDA
/// runtime's `out of memory`).
pub fn is_oom(message: &str) -> bool {
    message.contains("CUDA out of memory") || message.contains("CUDA error: out of memory")
}

/// Whether an error (any of its causes) is an out-of-memory paragraph of [`oom_paragraph`].
pub fn is_oom_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.to_string().starts_with(OOM_LEAD))
}

const OOM_LEAD: &str = "out of device memory in ";

/// A CUDA out-of-memory error as one paragraph: where it happened, libtorch's own first sentences
/// (what it tried to allocate, what the device had), and what would fit (the estimate's advice
/// where one was made).
pub fn oom_paragraph(place: &str, message: &str) -> String {
    // libtorch's message up to its advice on the allocator (PYTORCH_CUDA_ALLOC_CONF), one line.
    let start = message.find("CUDA out of memory").or_else(|| message.find("CUDA error")).unwrap_or(0);
    let what = message[start..].lines().next().unwrap_or("");
    let what = what.split(" Of the allocated memory").next().unwrap_or(what);
    let what = what.split(" If reserved but unallocated").next().unwrap_or(what).trim();
    let advice = ADVICE.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default();
    format!(
        "{OOM_LEAD}{place}: {what} {advice}{}Lower the micro-batch or `anchors_per_seq`, set \
         `checkpoint_layers = true` in [drafter], spread the target with `tensor_parallel = N` in [target], or \
         use an FP8 target; `dflash-host bench train` shows each part's estimate beside what it measures.",
        if advice.is_empty() { "" } else { " " }
    )
}

thread_local! {
    /// Set while [`catch_host_panic`] runs: its out-of-memory panics become errors, printed once.
    static CATCHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// A CUDA out-of-memory panic prints its paragraph instead of libtorch's C++ frames (and nothing
/// where [`catch_host_panic`] makes it an error); every other panic as before.
pub fn install_oom_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = panic_message(info.payload());
        match is_oom(&msg) {
            true if CATCHING.with(|c| c.get()) => {}
            true => eprintln!("error: {}", oom_paragraph("the host", &msg)),
            false => previous(info),
        }
    }));
}

/// A CUDA out-of-memory panic of host code (its tch calls) as an error ([`oom_paragraph`]), so a
/// failed step ends the run as other step errors do; any other panic goes on unwinding.
pub fn catch_host_panic<T>(place: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let outer = CATCHING.with(|c| c.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(outer));
    match result {
        Ok(r) => r,
        Err(payload) if is_oom(&panic_message(payload.as_ref())) => {
            bail!("{}", oom_paragraph(place, &panic_message(payload.as_ref())))
        }
        Err(payload) => std::panic::resume_unwind(payload),
    }
}
