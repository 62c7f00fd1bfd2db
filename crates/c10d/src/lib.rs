//! libtorch's c10d, the engine under torch.distributed, through a small C++ shim (csrc/):
//!
//! - [`Store`]: a `TCPStore` client (rank 0 also serves it), the rendezvous and a small
//!   key-value store every rank sees;
//! - [`ProcessGroup`]: a Gloo group for CPU tensors or an NCCL group for CUDA tensors, and the
//!   collectives the trainer needs on tch tensors: all-reduce, broadcast, all-gather, barrier.
//!
//! Gloo is in libtorch_cpu.so, so its half of the shim links into the binary. NCCL needs
//! libtorch_cuda.so, which cannot be loaded on a machine without CUDA: its half is a shared
//! library of its own, embedded in this crate and loaded the first time an NCCL group is made.

use std::{
    ffi::{c_char, c_int, c_void, CStr, CString},
    sync::{Arc, OnceLock},
    time::Duration,
};
use tch::Tensor;

/// A c10d call that failed, with libtorch's message (its first line).
#[derive(Debug, Clone, PartialEq)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

type ErrBuf = [c_char; 2048];

extern "C" {
    fn dflash_c10d_store_new(
        host: *const c_char,
        port: u16,
        listen_fd: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_store_free(s: *mut c_void);
    fn dflash_c10d_store_set(
        s: *mut c_void,
        key: *const c_char,
        data: *const u8,
        n: usize,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_store_get(
        s: *mut c_void,
        key: *const c_char,
        data: *mut *mut u8,
        n: *mut usize,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_bytes_free(data: *mut u8);
    fn dflash_c10d_store_check(
        s: *mut c_void,
        key: *const c_char,
        present: *mut bool,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn dflash_c10d_store_compare_set(
        s: *mut c_void,
        key: *const c_char,
        expected: *const u8,
        n_expected: usize,
        desired: *const u8,
        n_desired: usize,
        data: *mut *mut u8,
        n: *mut usize,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_store_add(
        s: *mut c_void,
        key: *const c_char,
        value: i64,
        now: *mut i64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_store_delete(
        s: *mut c_void,
        key: *const c_char,
        removed: *mut bool,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_store_num_keys(s: *mut c_void, n: *mut i64, err: *mut c_char, len: usize) -> c_int;
    fn dflash_c10d_store_raw(s: *mut c_void) -> *mut c_void;
    fn dflash_c10d_gloo_new(
        s: *mut c_void,
        prefix: *const c_char,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_group_adopt(backend: *mut c_void, timeout_ms: i64) -> *mut c_void;
    fn dflash_c10d_group_free(g: *mut c_void);
    fn dflash_c10d_all_reduce(g: *mut c_void, t: *const c_void, op: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_c10d_broadcast(g: *mut c_void, t: *const c_void, root: c_int, err: *mut c_char, len: usize) -> c_int;
    fn dflash_c10d_all_gather(
        g: *mut c_void,
        outputs: *const *const c_void,
        world: usize,
        input: *const c_void,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn dflash_c10d_barrier(g: *mut c_void, err: *mut c_char, len: usize) -> c_int;
}

/// Run a shim call that writes its error into a buffer; its message's first line on failure.
fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<()> {
    let mut err: ErrBuf = [0; 2048];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    // SAFETY: on failure the shim wrote a NUL-terminated message into `err`.
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
    Err(Error(first_line(&msg)))
}

/// libtorch's messages carry a C++ stack trace after the first line (and sometimes an
/// "Exception raised from" line); keep what a person reads.
fn first_line(msg: &str) -> String {
    msg.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("unknown c10d error").to_string()
}

fn cstr(s: &str) -> CString {
    CString::new(s.replace('\0', "")).expect("no NUL left")
}

/// A shim handle to a `TCPStore` client, freed when the last owner lets go (a call abandoned at its
/// deadline keeps its own).
struct RawStore(*mut c_void);

// SAFETY: a TCPStore client is a socket plus a lock that serialises its calls; it may be used
// from any thread.
unsafe impl Send for RawStore {}
unsafe impl Sync for RawStore {}

impl Drop for RawStore {
    fn drop(&mut self) {
        // SAFETY: the pointer came from dflash_c10d_store_new and is freed once.
        unsafe { dflash_c10d_store_free(self.0) }
    }
}

/// What the shim's TCPStore may take beyond its own timeout before a call is given up (its own
/// timeouts then speak first).
const DEADLINE_MARGIN: Duration = Duration::from_secs(2);

/// `f` on a thread of its own, given up after `deadline`: c10d's TCPStore client waits for an
/// answer without a timeout everywhere but in `get`, so a peer that accepts the connection and
/// never speaks (another program on the port, a stopped process) would hold the caller forever.
/// A call given up is left to finish (or not) on its thread, which owns what it uses.
fn bounded<T: Send + 'static>(
    deadline: Duration,
    silent: impl FnOnce() -> String,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("c10d-store".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| Error(format!("starting a store call: {e}")))?;
    rx.recv_timeout(deadline).unwrap_or_else(|_| Err(Error(silent())))
}

/// A `TCPStore` client (rank 0's also serves the store). Every call has a deadline: the store's
/// timeout (plus a little), whatever the peer does.
pub struct Store {
    raw: Arc<RawStore>,
    host: String,
    port: u16,
    timeout: Duration,
}

impl Store {
    /// Connect to the store at `host:port`, retrying up to `timeout`. Reads wait at most `timeout`
    /// for a key; every other call gets an answer within it or fails.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        Self::open(host, port, -1, timeout)
    }

    /// Serve the store on `listener` (bound by the caller, on the address it chooses) and connect
    /// to it; the store takes the socket over.
    pub fn serve(listener: std::net::TcpListener, timeout: Duration) -> Result<Self> {
        use std::os::fd::IntoRawFd;
        let addr = listener.local_addr().map_err(|e| Error(format!("the store's socket: {e}")))?;
        // Our own client connects where the socket listens (the loopback for "every interface").
        let ip = match addr.ip() {
            std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
            ip => ip,
        };
        Self::open(&ip.to_string(), addr.port(), listener.into_raw_fd(), timeout)
    }

    fn open(host: &str, port: u16, listen_fd: c_int, timeout: Duration) -> Result<Self> {
        let h = cstr(host);
        let shown = format!("{host}:{port}");
        let raw = bounded(
            timeout + DEADLINE_MARGIN,
            || {
                format!(
                    "{shown} accepted the connection but did not answer as a c10d store within {} s (another program on that port?)",
                    timeout.as_secs_f64()
                )
            },
            move || {
                let mut raw = std::ptr::null_mut();
                // SAFETY: plain arguments; the shim writes `raw` on success and owns `listen_fd` from here.
                call(|e, l| unsafe {
                    dflash_c10d_store_new(h.as_ptr(), port, listen_fd, timeout.as_millis() as i64, &mut raw, e, l)
                })?;
                Ok(RawStore(raw))
            },
        )?;
        Ok(Self { raw: Arc::new(raw), host: host.into(), port, timeout })
    }

    /// Another client of the same store (for a second thread).
    pub fn another(&self) -> Result<Self> {
        Self::connect(&self.host, self.port, self.timeout)
    }

    /// `host:port` of the store.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// `f` on the store within its deadline.
    fn run<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(*mut c_void, *mut c_char, usize) -> (c_int, T) + Send + 'static,
    ) -> Result<T> {
        let raw = Arc::clone(&self.raw);
        let silent =
            || format!("the store at {} did not answer {what} within {} s", self.address(), self.timeout.as_secs_f64());
        bounded(self.timeout + DEADLINE_MARGIN, silent, move || {
            let raw = raw;
            let mut out = None;
            call(|e, l| {
                let (rc, v) = f(raw.0, e, l);
                out = Some(v);
                rc
            })?;
            Ok(out.expect("set by the call"))
        })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (cstr(key), value.to_vec());
        // SAFETY: `k` and `v` live for the call.
        self.run("a write", move |s, e, l| {
            (unsafe { dflash_c10d_store_set(s, k.as_ptr(), v.as_ptr(), v.len(), e, l) }, ())
        })
    }

    /// The value of `key`, waiting for it up to the store's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let k = cstr(key);
        self.run("a read", move |s, e, l| {
            let (mut data, mut n) = (std::ptr::null_mut(), 0usize);
            // SAFETY: the shim mallocs `n` bytes into `data` on success; copied, then freed by it.
            let rc = unsafe { dflash_c10d_store_get(s, k.as_ptr(), &mut data, &mut n, e, l) };
            (rc, if rc == 0 { take_bytes(data, n) } else { Vec::new() })
        })
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool> {
        let k = cstr(key);
        self.run("a check", move |s, e, l| {
            let mut present = false;
            // SAFETY: plain arguments and one out-value.
            let rc = unsafe { dflash_c10d_store_check(s, k.as_ptr(), &mut present, e, l) };
            (rc, present)
        })
    }

    /// Add to the counter `key` (0 if unset) and return its new value.
    pub fn add(&self, key: &str, value: i64) -> Result<i64> {
        let k = cstr(key);
        self.run("an add", move |s, e, l| {
            let mut now = 0;
            // SAFETY: plain arguments and one out-value.
            let rc = unsafe { dflash_c10d_store_add(s, k.as_ptr(), value, &mut now, e, l) };
            (rc, now)
        })
    }

    /// Remove `key`; whether it was set.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let k = cstr(key);
        self.run("a delete", move |s, e, l| {
            let mut removed = false;
            // SAFETY: plain arguments and one out-value.
            let rc = unsafe { dflash_c10d_store_delete(s, k.as_ptr(), &mut removed, e, l) };
            (rc, removed)
        })
    }

    /// How many keys the store holds, every client's together.
    pub fn num_keys(&self) -> Result<u64> {
        self.run("a key count", move |s, e, l| {
            let mut n = 0i64;
            // SAFETY: one out-value.
            let rc = unsafe { dflash_c10d_store_num_keys(s, &mut n, e, l) };
            (rc, n.max(0) as u64)
        })
    }

    /// Set `key` to `desired` if it holds `expected` (an empty `expected`: if it is unset), in one
    /// step on the server; returns the value `key` holds afterwards (`desired` when it was set).
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let (k, x, d) = (cstr(key), expected.to_vec(), desired.to_vec());
        self.run("a compare-and-set", move |s, e, l| {
            let (mut data, mut n) = (std::ptr::null_mut(), 0usize);
            // SAFETY: as `get`; `x` and `d` live for the call.
            let rc = unsafe {
                dflash_c10d_store_compare_set(
                    s,
                    k.as_ptr(),
                    x.as_ptr(),
                    x.len(),
                    d.as_ptr(),
                    d.len(),
                    &mut data,
                    &mut n,
                    e,
                    l,
                )
            };
            (rc, if rc == 0 { take_bytes(data, n) } else { Vec::new() })
        })
    }
}

/// Copy and free bytes the shim malloc'ed.
fn take_bytes(data: *mut u8, n: usize) -> Vec<u8> {
    // SAFETY: `data` holds `n` bytes from the shim's malloc, freed once here.
    let v = unsafe { std::slice::from_raw_parts(data, n) }.to_vec();
    unsafe { dflash_c10d_bytes_free(data) };
    v
}

/// Which c10d backend a group runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CPU tensors (libtorch_cpu's Gloo, over TCP).
    Gloo,
    /// CUDA tensors (libtorch_cuda's NCCL: NVLink, InfiniBand or TCP between GPUs).
    Nccl,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// libtorch's flight recorder (a trace of recent collectives, for debugging hangs) adds each
/// group to a map outside its lock when the group's first collective starts; with two groups in
/// one process (a replica's ranks on threads, a target's group beside the drafter's) that can
/// corrupt the map and crash. The ranks gone are named from the heartbeats here, so it is off
/// unless `TORCH_FR_BUFFER_SIZE` or `TORCH_NCCL_TRACE_BUFFER_SIZE` asks for it. libtorch reads
/// the variable when the first group starts, after this.
pub fn flight_recorder_off_by_default() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"].iter().all(|v| std::env::var_os(v).is_none()) {
            std::env::set_var("TORCH_FR_BUFFER_SIZE", "0");
        }
    });
}

/// A c10d process group: `world` ranks that run the same collectives in the same order.
pub struct ProcessGroup {
    raw: *mut c_void,
    pub backend: Backend,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: c10d backends are used from one thread at a time here (the methods take &mut self
// where it matters, and callers hold the group behind a lock when they share it).
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    /// A group over the store's rendezvous (its keys under `prefix`); every rank must call this
    /// with the same prefix. Collectives fail after `timeout` instead of waiting for a dead peer
    /// forever.
    pub fn new(
        backend: Backend,
        store: &Store,
        prefix: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        flight_recorder_off_by_default();
        let p = cstr(prefix);
        let ms = timeout.as_millis() as i64;
        let raw = match backend {
            Backend::Gloo => {
                /// The new group, handed back from the thread that made it.
                struct Made(*mut c_void);
                // SAFETY: a group not used yet; it moves to the caller's thread once.
                unsafe impl Send for Made {}
                let store_raw = Arc::clone(&store.raw);
                let silent = || {
                    format!(
                        "making the Gloo group: the store at {} did not answer within {} s",
                        store.address(),
                        timeout.as_secs_f64()
                    )
                };
                bounded(timeout + DEADLINE_MARGIN, silent, move || {
                    let (store_raw, mut raw) = (store_raw, std::ptr::null_mut());
                    // SAFETY: the store is alive for the call (the group keeps its own reference).
                    call(|e, l| unsafe {
                        dflash_c10d_gloo_new(store_raw.0, p.as_ptr(), rank as c_int, world as c_int, ms, &mut raw, e, l)
                    })?;
                    Ok(Made(raw))
                })?
                .0
            }
            Backend::Nccl => {
                // Made on the calling thread (CUDA's current device is per thread); NCCL's own
                // watchdog bounds what it waits for.
                let new = nccl_library()?.new;
                let mut backend_raw = std::ptr::null_mut();
                // SAFETY: store_raw hands over a new reference, which the NCCL library takes;
                // on success it returns one reference to the backend, which adopt takes.
                call(|e, l| unsafe {
                    new(
                        dflash_c10d_store_raw(store.raw.0),
                        p.as_ptr(),
                        rank as c_int,
                        world as c_int,
                        ms,
                        &mut backend_raw,
                        e,
                        l,
                    )
                })?;
                // SAFETY: the reference the NCCL library returned, taken over once.
                unsafe { dflash_c10d_group_adopt(backend_raw, ms) }
            }
        };
        Ok(Self { raw, backend, rank, world })
    }

    /// `op` of `t` across ranks, in place. `t` must be contiguous, on the group's kind of device.
    pub fn all_reduce(&mut self, t: &Tensor, op: ReduceOp) -> Result<()> {
        let op = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
        };
        // SAFETY: tch handles are at::Tensor*; the shim reduces the tensor in place.
        call(|e, l| unsafe { dflash_c10d_all_reduce(self.raw, t.as_ptr() as *const c_void, op, e, l) })
    }

    /// Rank `root`'s `t` into every rank's `t`.
    pub fn broadcast(&mut self, t: &Tensor, root: usize) -> Result<()> {
        // SAFETY: as all_reduce.
        call(|e, l| unsafe { dflash_c10d_broadcast(self.raw, t.as_ptr() as *const c_void, root as c_int, e, l) })
    }

    /// Every rank's `input` into `outputs[rank]`: `world` tensors of the input's shape and dtype.
    pub fn all_gather(&mut self, outputs: &[Tensor], input: &Tensor) -> Result<()> {
        if outputs.len() != self.world {
            return Err(Error(format!("all_gather: {} outputs for a world of {}", outputs.len(), self.world)));
        }
        let ptrs: Vec<*const c_void> = outputs.iter().map(|t| t.as_ptr() as *const c_void).collect();
        // SAFETY: as all_reduce; `ptrs` holds `world` handles.
        call(|e, l| unsafe {
            dflash_c10d_all_gather(self.raw, ptrs.as_ptr(), ptrs.len(), input.as_ptr() as *const c_void, e, l)
        })
    }

    pub fn barrier(&mut self) -> Result<()> {
        // SAFETY: plain call on a live group.
        call(|e, l| unsafe { dflash_c10d_barrier(self.raw, e, l) })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim and is freed once.
        unsafe { dflash_c10d_group_free(self.raw) }
    }
}

/// The NCCL library (csrc/c10d_nccl.cpp) as built with this crate; empty when the build found no
/// NCCL headers.
static NCCL_LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libdflash_c10d_nccl.so"));

type NcclNew =
    unsafe extern "C" fn(*mut c_void, *const c_char, c_int, c_int, i64, *mut *mut c_void, *mut c_char, usize) -> c_int;
type NcclVersion = unsafe extern "C" fn(*mut c_char, usize) -> c_int;

struct Nccl {
    new: NcclNew,
    version: NcclVersion,
}

/// Write the embedded NCCL library to a file (named by its hash, so builds never mix) and load
/// it; libtorch's CUDA library must be loaded already (it resolves against it).
fn nccl_library() -> Result<&'static Nccl> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        if NCCL_LIBRARY.is_empty() {
            return Err("this build has no NCCL process group: it was compiled without NCCL's headers (`make setup` installs them into $DFLASH_CACHE/cuda-headers; rebuild)".into());
        }
        let lib = kernels::embedded_library::open(NCCL_LIBRARY, "dflash-c10d-nccl")
            .map_err(|e| format!("the NCCL process group: {e}"))?;
        let nccl = unsafe {
            Nccl {
                new: *lib.get::<NcclNew>(b"dflash_c10d_nccl_new\0").map_err(|e| e.to_string())?,
                version: *lib.get::<NcclVersion>(b"dflash_c10d_nccl_version\0").map_err(|e| e.to_string())?,
            }
        };
        std::mem::forget(lib);
        Ok(nccl)
    })
    .as_ref()
    .map_err(|e| Error(e.clone()))
}

/// NCCL's version as libtorch_cuda reports it (loads the NCCL library).
pub fn nccl_version() -> Result<String> {
    let mut buf: ErrBuf = [0; 2048];
    // SAFETY: the library writes a NUL-terminated string of at most `len` bytes.
    unsafe { (nccl_library()?.version)(buf.as_mut_ptr(), buf.len()) };
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// Whether this build carries the NCCL library (it was compiled with NCCL's headers).
pub fn has_nccl() -> bool {
    !NCCL_LIBRARY.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// `world` ranks on threads, each running `f(rank, group, store)`.
    fn ranks<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(usize, &mut ProcessGroup, &Store) -> T + Sync,
    ) -> Vec<T> {
        let port = free_port();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let store = if rank == 0 {
                            Store::serve(std::net::TcpListener::bind(("127.0.0.1", port)).unwrap(), timeout)
                        } else {
                            Store::connect("127.0.0.1", port, timeout)
                        }
                        .unwrap();
                        let mut pg = ProcessGroup::new(Backend::Gloo, &store, "test/", rank, world, timeout).unwrap();
                        f(rank, &mut pg, &store)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Making a group turns libtorch's flight recorder off where this process set neither
    /// variable (see [`flight_recorder_off_by_default`]).
    #[test]
    fn the_flight_recorder_is_off_once_a_group_is_made() {
        ranks(1, Duration::from_secs(30), |_, _, _| ());
        assert_eq!(std::env::var("TORCH_FR_BUFFER_SIZE").as_deref(), Ok("0"));
    }

    #[test]
    fn gloo_collectives_on_three_ranks() {
        let out = ranks(3, Duration::from_secs(30), |rank, pg, store| {
            let r = rank as f64;
            let t = Tensor::from_slice(&[r, 1.0, 10.0 * r]);
            pg.all_reduce(&t, ReduceOp::Sum).unwrap();
            let m = Tensor::from_slice(&[r as f32, -r as f32]);
            pg.all_reduce(&m, ReduceOp::Max).unwrap();
            let b =
                if rank == 1 { Tensor::from_slice(&[7i64, 8]) } else { Tensor::zeros([2], (Kind::Int64, Device::Cpu)) };
            pg.broadcast(&b, 1).unwrap();
            let outs: Vec<Tensor> = (0..3).map(|_| Tensor::zeros([2], (Kind::Float, Device::Cpu))).collect();
            pg.all_gather(&outs, &Tensor::from_slice(&[r as f32, 2.0 * r as f32])).unwrap();
            pg.barrier().unwrap();
            store.set(&format!("k{rank}"), &[rank as u8]).unwrap();
            let n = store.add("count", 1).unwrap();
            assert!((1..=3).contains(&n));
            (
                Vec::<f64>::try_from(&t).unwrap(),
                Vec::<f32>::try_from(&m).unwrap(),
                Vec::<i64>::try_from(&b).unwrap(),
                outs.iter().map(|o| Vec::<f32>::try_from(o).unwrap()).collect::<Vec<_>>(),
            )
        });
        for (sum, max, bcast, gathered) in out {
            assert_eq!(sum, vec![3.0, 3.0, 30.0]);
            assert_eq!(max, vec![2.0, 0.0]);
            assert_eq!(bcast, vec![7, 8]);
            assert_eq!(gathered, vec![vec![0.0, 0.0], vec![1.0, 2.0], vec![2.0, 4.0]]);
        }
    }

    #[test]
    fn the_store_reads_what_others_wrote_and_times_out_on_what_nobody_did() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = Store::serve(listener, Duration::from_millis(300)).unwrap();
        let client = server.another().unwrap();
        client.set("a", b"hello").unwrap();
        assert_eq!(server.get("a").unwrap(), b"hello");
        assert!(server.check("a").unwrap());
        assert!(!server.check("b").unwrap());
        // Deleting: the key is gone for every client, and the store counts one key fewer.
        client.set("gone", b"x").unwrap();
        let n = server.num_keys().unwrap();
        assert!(client.delete("gone").unwrap());
        assert!(!server.check("gone").unwrap() && !client.delete("gone").unwrap());
        assert_eq!(server.num_keys().unwrap(), n - 1);
        let t = std::time::Instant::now();
        let err = client.get("b").unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(!err.0.contains('\n'), "{err}");
        // Compare-and-set: the first claim wins, a second sees the first's value.
        assert_eq!(client.compare_set("claim", b"", b"one").unwrap(), b"one");
        assert_eq!(server.compare_set("claim", b"", b"two").unwrap(), b"one");
        assert_eq!(server.compare_set("claim", b"one", b"two").unwrap(), b"two");
    }

    /// The store listens where its socket was bound: on the loopback, no other interface reaches it.
    #[test]
    fn a_store_served_on_the_loopback_listens_there_only() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _server = Store::serve(listener, Duration::from_secs(5)).unwrap();
        let sockets = std::fs::read_to_string("/proc/net/tcp").unwrap();
        // Listening sockets (state 0A) on our port: local address 0100007F (127.0.0.1) only.
        let listening: Vec<&str> = sockets
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1).zip(l.split_whitespace().nth(3)))
            .filter(|(local, state)| *state == "0A" && local.ends_with(&format!(":{port:04X}")))
            .map(|(local, _)| local)
            .collect();
        assert_eq!(listening, vec![format!("0100007F:{port:04X}")]);
        let tcp6 = std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
        assert!(!tcp6.contains(&format!(":{port:04X} 00000000000000000000000000000000:0000 0A")), "{tcp6}");
    }

    /// A peer that accepts the connection and never answers (another program on the port): the
    /// connection fails at the timeout, naming the address, and so does a call to a store that
    /// stops answering.
    #[test]
    fn a_silent_peer_is_an_error_at_the_timeout_not_a_hang() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        let held = std::thread::spawn(move || silent.incoming().take(1).collect::<Vec<_>>());
        let t = std::time::Instant::now();
        let err = Store::connect("127.0.0.1", port, Duration::from_secs(1)).err().expect("a silent peer");
        assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
        assert!(err.0.contains(&format!("127.0.0.1:{port}")) && err.0.contains("did not answer"), "{err}");
        drop(held);
    }

    #[test]
    fn a_store_nobody_serves_is_an_error_after_the_timeout() {
        let t = std::time::Instant::now();
        let err = Store::connect("127.0.0.1", free_port(), Duration::from_millis(1500)).err().expect("no server");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(!err.0.is_empty());
    }
}
