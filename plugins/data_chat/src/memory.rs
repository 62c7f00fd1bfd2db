//! The plugin's allocator: the system's, counting per thread the bytes live, so that a template
//! rendering (untrusted code) is held to a memory limit ([`limited`]) whatever it builds.
//!
//! minijinja's fuel bounds what it charges for, but not every value it builds: a list added to
//! itself in a loop is kept lazy, then made whole without a charge once deep enough (2^33 items
//! after 33 doublings). The count here sees every byte. Past the limit the process ends at once
//! with one line naming the template and the limit, exit 2 as for any error: an allocation cannot
//! fail gracefully (the standard library aborts, and unwinding out of an allocator is undefined
//! behaviour), and a rendering holds nothing worth saving.
//!
//! For the tests, a thread can also arm a ceiling ([`measure`]) past which an allocation fails.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static CEILING: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The live bytes past which this thread's rendering ends the process, and what it renders.
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
    static LIMIT_BYTES: Cell<usize> = const { Cell::new(0) };
    static LABEL: Cell<(*const u8, usize)> = const { Cell::new((std::ptr::null(), 0)) };
}

// SAFETY: every call goes to the system allocator; the counters are plain thread-local cells
// (const-initialised, no destructor, so they never allocate themselves).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !grow(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        if new_size < layout.size() {
            shrink(layout.size() - new_size);
        }
        System.realloc(ptr, layout, new_size)
    }
}

/// Counts `n` more bytes on this thread; false when that would pass its ceiling (tests).
fn grow(n: usize) -> bool {
    let counted = LIVE.try_with(|live| {
        let now = live.get().saturating_add(n);
        if now > LIMIT.try_with(Cell::get).unwrap_or(usize::MAX) {
            over_limit();
        }
        if now > CEILING.try_with(Cell::get).unwrap_or(usize::MAX) {
            return false;
        }
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        true
    });
    counted.unwrap_or(true)
}

fn shrink(n: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(n)));
}

/// One line on stderr naming the template and the limit, then exit 2. Nothing here allocates.
fn over_limit() -> ! {
    let (ptr, len) = LABEL.try_with(Cell::get).unwrap_or((std::ptr::null(), 0));
    // SAFETY: LABEL points into the `&str` that `limited` borrows while it runs.
    let label = if ptr.is_null() { "a chat template" } else { unsafe { str_at(ptr, len) } };
    let mib = LIMIT_BYTES.try_with(Cell::get).unwrap_or(0) >> 20;
    let mut line = Line { buf: [0; 1024], len: 0 };
    let _ = std::fmt::Write::write_fmt(
        &mut line,
        format_args!(
            "error: {label}: its rendering passed its memory limit of {mib} MiB (a value it builds, such as a \
             list doubled in a loop, grows without bound)\n"
        ),
    );
    // SAFETY: write(2) of our own buffer to stderr, then _exit(2): no allocation, no unwinding.
    unsafe {
        libc::write(2, line.buf.as_ptr().cast(), line.len);
        libc::_exit(2)
    }
}

/// # Safety
/// `ptr..ptr + len` is a live UTF-8 string.
unsafe fn str_at<'a>(ptr: *const u8, len: usize) -> &'a str {
    std::str::from_utf8_unchecked(std::slice::from_raw_parts(ptr, len))
}

/// A line formatted without allocating (cut at its buffer's end).
struct Line {
    buf: [u8; 1024],
    len: usize,
}

impl std::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` (a rendering of `label`) on this thread with at most `bytes` more live than now;
/// past them the process ends with one line naming `label` and the limit.
pub fn limited<T>(label: &str, bytes: usize, f: impl FnOnce() -> T) -> T {
    /// What was armed before, put back when `f` returns or unwinds.
    struct Restore((usize, usize, (*const u8, usize)));
    impl Drop for Restore {
        fn drop(&mut self) {
            let (limit, bytes, label) = self.0;
            LIMIT.with(|l| l.set(limit));
            LIMIT_BYTES.with(|b| b.set(bytes));
            LABEL.with(|l| l.set(label));
        }
    }
    let _restore = Restore((LIMIT.with(Cell::get), LIMIT_BYTES.with(Cell::get), LABEL.with(Cell::get)));
    LABEL.with(|l| l.set((label.as_ptr(), label.len())));
    LIMIT_BYTES.with(|b| b.set(bytes));
    LIMIT.with(|l| l.set(LIVE.with(Cell::get).saturating_add(bytes)));
    f()
}

/// Runs `f` on this thread with at most `ceiling` bytes allocated beyond what is live now, and
/// returns its result with the most it had allocated at once (bytes above the start).
#[cfg(test)]
pub fn measure<T>(ceiling: usize, f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    CEILING.with(|c| c.set(start.saturating_add(ceiling)));
    let out = f();
    CEILING.with(|c| c.set(usize::MAX));
    (out, PEAK.with(Cell::get) - start)
}
