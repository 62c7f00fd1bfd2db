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
    path::PathBuf,
    sync::OnceLock,
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
        server: bool,
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
    fn dflash_c10d_store_add(
        s: *mut c_void,
        key: *const c_char,
        value: i64,
        now: *mut i64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
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

/// A `TCPStore` client. Each thread that talks to the store while another does should have its
/// own (calls on one client are serialised).
pub struct Store {
    raw: *mut c_void,
    host: String,
    port: u16,
    timeout: Duration,
}

// SAFETY: a TCPStore client is a socket plus a lock; it may move between threads.
unsafe impl Send for Store {}

impl Store {
    /// Connect to the store at `host:port`, retrying up to `timeout`; with `server`, also serve it
    /// (rank 0). Reads wait at most `timeout` for a key.
    pub fn connect(host: &str, port: u16, server: bool, timeout: Duration) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        let h = cstr(host);
        // SAFETY: plain arguments; the shim writes `raw` on success.
        call(|e, l| unsafe {
            dflash_c10d_store_new(h.as_ptr(), port, server, timeout.as_millis() as i64, &mut raw, e, l)
        })?;
        Ok(Self { raw, host: host.into(), port, timeout })
    }

    /// Another client of the same store (for a second thread).
    pub fn another(&self) -> Result<Self> {
        Self::connect(&self.host, self.port, false, self.timeout)
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = cstr(key);
        // SAFETY: `value` is valid for its length during the call.
        call(|e, l| unsafe { dflash_c10d_store_set(self.raw, k.as_ptr(), value.as_ptr(), value.len(), e, l) })
    }

    /// The value of `key`, waiting for it up to the store's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let k = cstr(key);
        let (mut data, mut n) = (std::ptr::null_mut(), 0usize);
        // SAFETY: the shim mallocs `n` bytes into `data` on success; copied, then freed by it.
        call(|e, l| unsafe { dflash_c10d_store_get(self.raw, k.as_ptr(), &mut data, &mut n, e, l) })?;
        let v = unsafe { std::slice::from_raw_parts(data, n) }.to_vec();
        unsafe { dflash_c10d_bytes_free(data) };
        Ok(v)
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool> {
        let k = cstr(key);
        let mut present = false;
        // SAFETY: plain arguments and one out-value.
        call(|e, l| unsafe { dflash_c10d_store_check(self.raw, k.as_ptr(), &mut present, e, l) })?;
        Ok(present)
    }

    /// Add to the counter `key` (0 if unset) and return its new value.
    pub fn add(&self, key: &str, value: i64) -> Result<i64> {
        let k = cstr(key);
        let mut now = 0;
        // SAFETY: plain arguments and one out-value.
        call(|e, l| unsafe { dflash_c10d_store_add(self.raw, k.as_ptr(), value, &mut now, e, l) })?;
        Ok(now)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: `raw` came from dflash_c10d_store_new and is freed once.
        unsafe { dflash_c10d_store_free(self.raw) }
    }
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
        let p = cstr(prefix);
        let ms = timeout.as_millis() as i64;
        let mut raw = std::ptr::null_mut();
        match backend {
            Backend::Gloo => {
                // SAFETY: the store is alive for the call (the group keeps its own reference).
                call(|e, l| unsafe {
                    dflash_c10d_gloo_new(store.raw, p.as_ptr(), rank as c_int, world as c_int, ms, &mut raw, e, l)
                })?;
            }
            Backend::Nccl => {
                let new = nccl_library()?.new;
                let mut backend_raw = std::ptr::null_mut();
                // SAFETY: store_raw hands over a new reference, which the NCCL library takes;
                // on success it returns one reference to the backend, which adopt takes.
                call(|e, l| unsafe {
                    new(
                        dflash_c10d_store_raw(store.raw),
                        p.as_ptr(),
                        rank as c_int,
                        world as c_int,
                        ms,
                        &mut backend_raw,
                        e,
                        l,
                    )
                })?;
                raw = unsafe { dflash_c10d_group_adopt(backend_raw, ms) };
            }
        }
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
        use sha2::Digest;
        let hash: String = sha2::Sha256::digest(NCCL_LIBRARY).iter().take(8).map(|b| format!("{b:02x}")).collect();
        let path: PathBuf = std::env::temp_dir().join(format!("dflash-c10d-nccl-{hash}.so"));
        if std::fs::metadata(&path).map(|m| m.len() as usize).ok() != Some(NCCL_LIBRARY.len()) {
            let tmp = path.with_extension(format!("so.{}", std::process::id()));
            std::fs::write(&tmp, NCCL_LIBRARY).and_then(|_| std::fs::rename(&tmp, &path)).map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
        // SAFETY: our own library; it stays loaded for the process's life.
        let lib = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| format!("loading the NCCL process group ({}): {e}", path.display()))?;
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
                        let store = Store::connect("127.0.0.1", port, rank == 0, timeout).unwrap();
                        let mut pg = ProcessGroup::new(Backend::Gloo, &store, "test/", rank, world, timeout).unwrap();
                        f(rank, &mut pg, &store)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
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
        let port = free_port();
        let server = Store::connect("127.0.0.1", port, true, Duration::from_millis(300)).unwrap();
        let client = server.another().unwrap();
        client.set("a", b"hello").unwrap();
        assert_eq!(server.get("a").unwrap(), b"hello");
        assert!(server.check("a").unwrap());
        assert!(!server.check("b").unwrap());
        let t = std::time::Instant::now();
        let err = client.get("b").unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(!err.0.contains('\n'), "{err}");
    }

    #[test]
    fn a_store_nobody_serves_is_an_error_after_the_timeout() {
        let t = std::time::Instant::now();
        let err =
            Store::connect("127.0.0.1", free_port(), false, Duration::from_millis(1500)).err().expect("no server");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(!err.0.is_empty());
    }
}
