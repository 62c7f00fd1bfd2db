//! Data-parallel replicas of the whole pipeline: each rank runs its own targets and drafter on
//! its share of every step's micro-batches, and the drafter gradients are summed across ranks
//! before clipping, so R replicas with K micro-batches each take the step one replica takes with
//! R x K.
//!
//! Ranks meet through the launchers' environment (torchrun, Slurm, `train --nproc N`): `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. The transport is libtorch's c10d
//! (crates/c10d): a `TCPStore` served by rank 0 for the rendezvous, Gloo for CPU replicas, NCCL
//! for CUDA ones. At the rendezvous the ranks compare their world size, config and build, and
//! refuse to start with a line naming the rank that differs. A rank that dies or stops answering
//! turns every other rank's next collective into an error naming it (each rank beats a counter
//! in the store; the rank whose counter stopped is the one named), never a hang.

use anyhow::{anyhow, bail, Context, Result};
use c10d::{Backend, ProcessGroup, ReduceOp, Store};
use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RResult, RSlice},
    },
    tch::{Device, Tensor},
    Collectives, CollectivesBox, Collectives_TO, PluginError, TensorHandle,
};
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

/// How long a collective or the rendezvous may wait for a peer (torch.distributed's default);
/// `DFLASH_DIST_TIMEOUT` (seconds) overrides it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// Where this process sits among the replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct DistEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub timeout: Duration,
}

impl DistEnv {
    /// From the launcher's variables; None when `WORLD_SIZE` is unset.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let num = |k: &str| -> Result<Option<usize>> {
            var(k).map(|v| v.trim().parse::<usize>().with_context(|| format!("environment variable {k}=`{v}`: not a number"))).transpose()
        };
        // A launcher's world of 1 (torchrun --nproc-per-node 1) runs through c10d too.
        let Some(world) = num("WORLD_SIZE")? else { return Ok(None) };
        if world == 0 {
            bail!("WORLD_SIZE=0: a world needs at least one rank");
        }
        let rank = num("RANK")?.context("WORLD_SIZE is set but RANK is not")?;
        if rank >= world {
            bail!("RANK {rank} is not below WORLD_SIZE {world}");
        }
        let master_port = var("MASTER_PORT").context("WORLD_SIZE is set but MASTER_PORT is not")?;
        let timeout = match num("DFLASH_DIST_TIMEOUT")? {
            Some(0) => bail!("environment variable DFLASH_DIST_TIMEOUT=0: the timeout must be at least 1 s"),
            Some(s) => Duration::from_secs(s as u64),
            None => DEFAULT_TIMEOUT,
        };
        Ok(Some(Self {
            rank,
            world,
            local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
            master_addr: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port: master_port.trim().parse().with_context(|| format!("MASTER_PORT=`{master_port}`: not a port"))?,
            timeout,
        }))
    }
}

/// NVLink multicast (NVLS) off unless the user chose: it can take a host's GPUs, which others
/// may share, out of service. Call before any thread starts (it sets an environment variable).
pub fn set_nccl_defaults() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}

/// What ranks must agree on to train together, as hashes: the resolved config (without device
/// placement, which is each rank's own) and the build (binary and plugin libraries).
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    pub config: String,
    pub build: String,
}

/// Collectives the trainer needs.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Element-wise sum of a few f64 values across ranks, in place (loss, counts, flags); every
    /// rank gets the same bits.
    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<()>;
    /// Element-wise sum of each tensor across ranks, in place, bucketed: the tensors are
    /// flattened into a few large buffers (one collective each), not one call per tensor.
    fn all_reduce_sum_tensors(&mut self, tensors: &[Tensor]) -> Result<()>;
    /// Rank `root`'s values of `tensors` into every rank's, in place.
    fn broadcast(&mut self, tensors: &[Tensor], root: usize) -> Result<()>;
    fn barrier(&mut self) -> Result<()>;
    /// The same process group lent to a plugin (the optimizer's `set_collectives`).
    fn collectives(&self) -> CollectivesBox;
}

/// The gradients of `params`; every rank must have all of them.
fn gradients(params: &[Tensor]) -> Result<Vec<Tensor>> {
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
    let missing = grads.iter().filter(|g| !g.defined()).count();
    if missing > 0 {
        bail!("{missing} of {} drafter parameters have no gradient; every rank must have all of them", grads.len());
    }
    Ok(grads)
}

/// Sum the gradients of `params` across ranks, in place (bucketed).
pub fn sum_gradients(comm: &mut dyn Communicator, params: &[Tensor]) -> Result<()> {
    let _guard = plugin_api::tch::no_grad_guard();
    comm.all_reduce_sum_tensors(&gradients(params)?)
}

/// Average the gradients of `params` across ranks: the sum, then 1 / world.
pub fn average_gradients(comm: &mut dyn Communicator, params: &[Tensor]) -> Result<()> {
    sum_gradients(comm, params)?;
    let _guard = plugin_api::tch::no_grad_guard();
    let scale = 1.0 / comm.world() as f64;
    for mut g in gradients(params)? {
        let _ = g.g_mul_scalar_(scale);
    }
    Ok(())
}

/// Buckets of the tensors to all-reduce: runs of the same dtype and device, each at most
/// `cap` bytes (a larger tensor alone), in order.
pub(crate) fn buckets(tensors: &[Tensor], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, t) in tensors.iter().enumerate() {
        let size = t.numel() * t.kind().elt_size_in_bytes();
        let same = i > start && (t.kind(), t.device()) == (tensors[start].kind(), tensors[start].device());
        if i > start && (!same || bytes + size > cap) {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < tensors.len() {
        out.push(start..tensors.len());
    }
    out
}

/// How often each rank beats its counter in the store, and how many beats a rank may miss
/// before it is named as gone.
const HEARTBEAT: Duration = Duration::from_secs(1);
const MISSED_BEATS: u32 = 3;

/// The default all-reduce bucket: large, since the all-reduce runs after the backward (nothing to
/// overlap with), and a bucket costs one flat copy of its gradients in memory.
pub const DEFAULT_BUCKET_BYTES: usize = 128 << 20;

/// The group and what names a failed peer; shared by the trainer and the plugins it lends the
/// group to.
struct Shared {
    group: Mutex<ProcessGroup>,
    /// The main store client (rendezvous, diagnosis); the heartbeat has its own.
    store: Mutex<Store>,
    rank: usize,
    world: usize,
    /// Where the group's tensors live: the CPU for Gloo, the drafter's GPU for NCCL.
    device: Device,
    timeout: Duration,
    beating: Arc<AtomicBool>,
    heartbeat: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Shared {
    /// Run one collective; a failure becomes an error that names the rank that is gone.
    fn run(&self, what: &str, f: impl FnOnce(&mut ProcessGroup) -> c10d::Result<()>) -> Result<()> {
        let result = f(&mut self.group.lock().expect("group lock"));
        result.map_err(|e| self.explain(what, e))
    }

    fn explain(&self, what: &str, e: c10d::Error) -> anyhow::Error {
        let me = self.rank;
        let gone = self.gone_ranks();
        if me == 0 {
            // Rank 0 serves the store: stay a little, so the others' diagnosis can still read it.
            std::thread::sleep(HEARTBEAT * (MISSED_BEATS + 2));
        }
        match gone {
            Ok(gone) if !gone.is_empty() => {
                let who: Vec<String> = gone.iter().map(|r| r.to_string()).collect();
                let s = if gone.len() > 1 { "s" } else { "" };
                anyhow!("rank{s} {} gone (no heartbeat for {} s): {what} failed on rank {me}: {e}", who.join(", "), MISSED_BEATS)
            }
            Ok(_) => anyhow!("{what} failed on rank {me} with every rank alive (one may be stuck; timeout {} s): {e}", self.timeout.as_secs()),
            Err(store) => anyhow!("rank 0 gone (the rendezvous store it serves does not answer: {store}): {what} failed on rank {me}: {e}"),
        }
    }

    /// The ranks whose heartbeat stopped: counters read, then again after a few beats.
    fn gone_ranks(&self) -> c10d::Result<Vec<usize>> {
        let store = self.store.lock().expect("store lock");
        let read = || (0..self.world).map(|r| store.add(&beat_key(r), 0)).collect::<c10d::Result<Vec<i64>>>();
        let before = read()?;
        std::thread::sleep(HEARTBEAT * MISSED_BEATS);
        let after = read()?;
        Ok((0..self.world).filter(|&r| r != self.rank && after[r] == before[r]).collect())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.beating.store(false, Ordering::Relaxed);
        if let Some(h) = self.heartbeat.lock().expect("heartbeat lock").take() {
            let _ = h.join();
        }
    }
}

fn beat_key(rank: usize) -> String {
    format!("dflash/beat/{rank}")
}

fn hello_key(rank: usize) -> String {
    format!("dflash/hello/{rank}")
}

/// The data-parallel communicator on c10d.
pub struct C10dCommunicator {
    shared: Arc<Shared>,
    bucket_bytes: usize,
}

impl C10dCommunicator {
    /// Meet the other ranks through rank 0's store, check that they run the same thing, and make
    /// the process group: Gloo when `device` is the CPU, NCCL on a CUDA device.
    pub fn connect(env: &DistEnv, device: Device, identity: &Identity) -> Result<Self> {
        let (rank, world, timeout) = (env.rank, env.world, env.timeout);
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        let store = Store::connect(&env.master_addr, env.master_port, rank == 0, timeout).map_err(|e| {
            if rank == 0 {
                anyhow!("rank 0: serving the rendezvous store on {addr}: {e}")
            } else {
                anyhow!("rank 0 gone: rank {rank} could not reach its rendezvous store at {addr} within {} s: {e}", timeout.as_secs())
            }
        })?;
        // 1. Everyone says who they are, then waits for everyone (naming who never came).
        let hello = format!("world size {world}, config {}, build {}", identity.config, identity.build);
        store.set(&hello_key(rank), hello.as_bytes()).map_err(|e| anyhow!("rank {rank}: rendezvous at {addr}: {e}"))?;
        let deadline = Instant::now() + timeout;
        loop {
            let mut missing = Vec::new();
            for r in 0..world {
                if !store.check(&hello_key(r)).map_err(|e| anyhow!("rank {rank}: rendezvous at {addr}: {e}"))? {
                    missing.push(r.to_string());
                }
            }
            if missing.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                let s = if missing.len() > 1 { "s" } else { "" };
                bail!("rank{s} {} did not join the rendezvous at {addr} within {} s (world size {world})", missing.join(", "), timeout.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // 2. The same world, config and build everywhere, or one line naming who differs. Rank 0
        //    serves the store, so it waits until every rank has read before it may leave.
        let rdv = |e: c10d::Error| anyhow!("rank {rank}: rendezvous at {addr}: {e}");
        let hellos = (0..world).map(|r| store.get(&hello_key(r)).map(|v| String::from_utf8_lossy(&v).into_owned())).collect::<c10d::Result<Vec<_>>>().map_err(rdv)?;
        store.add("dflash/checked", 1).map_err(rdv)?;
        while rank == 0 && store.add("dflash/checked", 0).map_err(rdv)? < world as i64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some((r, theirs)) = hellos.iter().enumerate().find(|(_, h)| *h != &hellos[0]) {
            let diff = hellos[0].split(", ").zip(theirs.split(", ")).find(|(a, b)| a != b).map_or_else(
                || format!("`{theirs}` vs `{}`", hellos[0]),
                |(a, b)| format!("{b} vs {a} on rank 0"),
            );
            bail!("rank {r} differs from rank 0: {diff}; every rank must run the same build with the same config");
        }
        // 3. The group, and the heartbeat that names a rank that dies.
        let backend = if device == Device::Cpu { Backend::Gloo } else { Backend::Nccl };
        let group = ProcessGroup::new(backend, &store, "dflash/pg/", rank, world, timeout)
            .map_err(|e| anyhow!("rank {rank}: making the {} process group: {e}", backend.name()))?;
        let beats = store.another().map_err(|e| anyhow!("rank {rank}: a second store client: {e}"))?;
        let beating = Arc::new(AtomicBool::new(true));
        let flag = Arc::clone(&beating);
        let heartbeat = std::thread::Builder::new().name("dist-heartbeat".into()).spawn(move || {
            while flag.load(Ordering::Relaxed) {
                if beats.add(&beat_key(rank), 1).is_err() {
                    return; // the store is gone; the next collective says so
                }
                let beat = Instant::now();
                while flag.load(Ordering::Relaxed) && beat.elapsed() < HEARTBEAT {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })?;
        tracing::info!("rank {rank} of {world}: c10d {} through {addr}", backend.name());
        let shared = Shared {
            group: Mutex::new(group),
            store: Mutex::new(store),
            rank,
            world,
            device,
            timeout,
            beating,
            heartbeat: Mutex::new(Some(heartbeat)),
        };
        Ok(Self { shared: Arc::new(shared), bucket_bytes: DEFAULT_BUCKET_BYTES })
    }

    /// All-reduce buckets of at most this many bytes (a larger tensor goes alone).
    pub fn set_bucket_bytes(&mut self, bytes: usize) {
        self.bucket_bytes = bytes.max(1);
    }

    pub fn backend(&self) -> Backend {
        self.shared.group.lock().expect("group lock").backend
    }
}

impl Communicator for C10dCommunicator {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<()> {
        let t = Tensor::from_slice(values).to_device(self.shared.device);
        self.shared.run("all-reduce of the step's sums", |g| g.all_reduce(&t, ReduceOp::Sum))?;
        values.copy_from_slice(&Vec::<f64>::try_from(t.to_device(Device::Cpu))?);
        Ok(())
    }

    fn all_reduce_sum_tensors(&mut self, tensors: &[Tensor]) -> Result<()> {
        let _guard = plugin_api::tch::no_grad_guard();
        for range in buckets(tensors, self.bucket_bytes) {
            let part = &tensors[range];
            if let [t] = part {
                if t.is_contiguous() {
                    self.shared.run("all-reduce of the gradients", |g| g.all_reduce(t, ReduceOp::Sum))?;
                    continue;
                }
            }
            // 1. Flatten the bucket into one buffer, 2. reduce it, 3. copy each part back.
            let flat = Tensor::cat(&part.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0);
            self.shared.run("all-reduce of the gradients", |g| g.all_reduce(&flat, ReduceOp::Sum))?;
            let mut offset = 0;
            for t in part {
                let n = t.numel() as i64;
                t.shallow_clone().copy_(&flat.narrow(0, offset, n).view(t.size().as_slice()));
                offset += n;
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, tensors: &[Tensor], root: usize) -> Result<()> {
        let _guard = plugin_api::tch::no_grad_guard();
        for t in tensors {
            let c = t.contiguous();
            self.shared.run("broadcast", |g| g.broadcast(&c, root))?;
            if c.data_ptr() != t.data_ptr() {
                t.shallow_clone().copy_(&c);
            }
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.shared.run("barrier", |g| g.barrier())
    }

    fn collectives(&self) -> CollectivesBox {
        Collectives_TO::from_value(Lent(Arc::clone(&self.shared)), TD_Opaque)
    }
}

/// The group as a plugin sees it.
struct Lent(Arc<Shared>);

impl Collectives for Lent {
    fn rank(&self) -> u32 {
        self.0.rank as u32
    }

    fn world(&self) -> u32 {
        self.0.world as u32
    }

    fn all_gather(&mut self, outputs: RSlice<'_, TensorHandle>, input: &TensorHandle) -> RResult<(), PluginError> {
        let outs: Vec<Tensor> = outputs.iter().map(|h| h.tensor()).collect();
        let input = input.tensor();
        self.0.run("all-gather", |g| g.all_gather(&outs, &input)).map_err(|e| PluginError::new(format!("{e:#}"))).into()
    }
}

/// Each rank's own devices on a machine shared by several ranks: the config's CUDA devices
/// offset by `local_rank` x the number of GPUs one replica uses (`cuda:0` on every rank of
/// `--nproc 4` becomes cuda:0..3). Where each rank sees only its own GPUs (`visible` no larger
/// than one replica needs, as Slurm's per-task CUDA_VISIBLE_DEVICES gives), nothing moves.
pub fn rank_devices(devices: &[String], local_rank: usize, visible: usize) -> Result<Vec<String>> {
    let index = |d: &str| d.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok());
    let per_replica = devices.iter().filter_map(|d| index(d)).max().map_or(0, |m| m + 1);
    if per_replica == 0 || local_rank == 0 || visible <= per_replica {
        return Ok(devices.to_vec());
    }
    let offset = local_rank * per_replica;
    if offset + per_replica > visible {
        bail!(
            "local rank {local_rank} needs cuda:{offset}..cuda:{} ({per_replica} GPUs a replica), but {visible} are visible",
            offset + per_replica - 1
        );
    }
    Ok(devices.iter().map(|d| index(d).map_or_else(|| d.clone(), |i| format!("cuda:{}", i + offset))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Kind;

    #[test]
    fn the_launcher_environment_is_read_and_checked() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_PORT", "2")])).unwrap().map(|e| e.world), Some(1));
        let env = DistEnv::from_vars(vars(&[("WORLD_SIZE", "4"), ("RANK", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")]))
            .unwrap()
            .unwrap();
        assert_eq!((env.rank, env.world, env.local_rank, env.master_addr.as_str(), env.master_port), (2, 4, 0, "node0", 29500));
        assert_eq!(env.timeout, DEFAULT_TIMEOUT);
        let env = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_PORT", "1"), ("DFLASH_DIST_TIMEOUT", "20")])).unwrap().unwrap();
        assert_eq!(env.timeout, Duration::from_secs(20));
        let err = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_PORT", "1")])).unwrap_err();
        assert!(err.to_string().contains("RANK 2 is not below WORLD_SIZE 2"), "{err}");
        let err = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "x")])).unwrap_err();
        assert!(err.to_string().contains("RANK=`x`"), "{err}");
        assert!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "1")])).unwrap_err().to_string().contains("MASTER_PORT"));
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// `world` ranks on threads, each connecting with `identity(rank)` and running `f`.
    fn ranks<T: Send>(world: usize, identity: impl Fn(usize) -> Identity + Sync, f: impl Fn(&mut C10dCommunicator) -> T + Sync) -> Vec<Result<T>> {
        let port = free_port();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (f, identity) = (&f, &identity);
                    s.spawn(move || {
                        let env = DistEnv { rank, world, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port, timeout: Duration::from_secs(20) };
                        C10dCommunicator::connect(&env, Device::Cpu, &identity(rank)).map(|mut c| f(&mut c))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn same(_: usize) -> Identity {
        Identity { config: "c".into(), build: "b".into() }
    }

    /// Three ranks on Gloo: f64 sums, bucketed tensor sums (several buckets, mixed dtypes, a
    /// non-contiguous tensor), the gradient average, a broadcast from rank 0 and a lent all-gather.
    #[test]
    fn three_ranks_sum_average_broadcast_and_gather() {
        let out = ranks(3, same, |c| {
            c.set_bucket_bytes(40); // 10 f32s: several buckets
            let r = c.rank() as f64;
            let mut sums = vec![r, 1.0, 0.1 * r];
            c.all_reduce_sum(&mut sums).unwrap();
            let ts = [
                Tensor::from_slice(&[r as f32; 7]),
                Tensor::from_slice(&[1.0f32; 12]).view([3, 4]).tr(),
                Tensor::from_slice(&[r; 3]),
                Tensor::from_slice(&[2.0f32 * r as f32; 5]),
            ];
            c.all_reduce_sum_tensors(&ts).unwrap();
            let p = Tensor::from_slice(&[r as f32, 1.0]).set_requires_grad(true);
            (&p * Tensor::from_slice(&[1.0f32 + r as f32, 3.0])).sum(Kind::Float).backward();
            average_gradients(c, std::slice::from_ref(&p)).unwrap();
            c.broadcast(std::slice::from_ref(&p), 0).unwrap();
            let mut lent = c.collectives();
            let outs: Vec<Tensor> = (0..3).map(|_| Tensor::zeros([2], (Kind::Int64, Device::Cpu))).collect();
            let handles: Vec<TensorHandle> = outs.iter().map(|t| TensorHandle::new(t.shallow_clone())).collect();
            lent.all_gather(handles.as_slice().into(), &TensorHandle::new(Tensor::from_slice(&[c.rank() as i64, 7]))).unwrap();
            c.barrier().unwrap();
            let v = |t: &Tensor| Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap();
            (sums, ts.iter().map(v).collect::<Vec<_>>(), v(&p.grad()), v(&p.detach()), outs.iter().map(v).collect::<Vec<_>>())
        });
        for o in out {
            let (sums, ts, grad, p, gathered) = o.unwrap();
            assert_eq!(sums, vec![3.0, 3.0, (0.0 + 0.1) + 0.2]);
            assert_eq!(ts, vec![vec![3.0; 7], vec![3.0; 12], vec![3.0; 3], vec![6.0; 5]]);
            assert_eq!(grad, vec![2.0, 3.0]);
            assert_eq!(p, vec![0.0, 1.0]);
            assert_eq!(gathered, vec![vec![0.0, 7.0], vec![1.0, 7.0], vec![2.0, 7.0]]);
        }
    }

    /// A rank with another config is refused at the rendezvous, on every rank, in one line that
    /// names it.
    #[test]
    fn a_rank_with_another_config_is_named_at_the_rendezvous() {
        let out = ranks(3, |r| Identity { config: if r == 2 { "x".into() } else { "c".into() }, build: "b".into() }, |_| ());
        for o in out {
            let e = format!("{:#}", o.unwrap_err());
            assert!(e.starts_with("rank 2 differs from rank 0: config x vs config c on rank 0"), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    /// A rank that never comes: the others stop after the timeout, naming it.
    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let port = free_port();
        let env = DistEnv { rank: 0, world: 2, local_rank: 0, master_addr: "127.0.0.1".into(), master_port: port, timeout: Duration::from_secs(2) };
        let t = Instant::now();
        let e = format!("{:#}", C10dCommunicator::connect(&env, Device::Cpu, &same(0)).err().expect("rank 1 never came"));
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(e.starts_with("rank 1 did not join the rendezvous"), "{e}");
    }

    #[test]
    fn buckets_split_by_size_and_dtype() {
        let f = |n: i64| Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let d = |n: i64| Tensor::zeros([n], (Kind::Double, Device::Cpu));
        let ts = [f(2), f(2), f(10), d(1), d(1), f(1)];
        assert_eq!(buckets(&ts, 16), vec![0..2, 2..3, 3..5, 5..6]);
        assert_eq!(buckets(&ts, 1 << 20), vec![0..3, 3..5, 5..6]);
        assert!(buckets(&[], 16).is_empty());
    }

    #[test]
    fn each_local_rank_gets_its_own_gpus() {
        let s = |v: &[&str]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>();
        assert_eq!(rank_devices(&s(&["cuda:0"]), 3, 8).unwrap(), s(&["cuda:3"]));
        assert_eq!(rank_devices(&s(&["cuda:0", "cuda:1", "cuda:2", "cuda:3"]), 1, 8).unwrap(), s(&["cuda:4", "cuda:5", "cuda:6", "cuda:7"]));
        assert_eq!(rank_devices(&s(&["cpu"]), 2, 0).unwrap(), s(&["cpu"]));
        // Slurm's per-task CUDA_VISIBLE_DEVICES: each rank sees one GPU, already its own.
        assert_eq!(rank_devices(&s(&["cuda:0"]), 5, 1).unwrap(), s(&["cuda:0"]));
        let e = rank_devices(&s(&["cuda:0", "cuda:1"]), 2, 5).unwrap_err().to_string();
        assert!(e.contains("local rank 2 needs cuda:4..cuda:5"), "{e}");
    }
}
