//! The process group: rank 0's store, Gloo or NCCL, and the heartbeat that names a rank that
//! died (see the module above for how the ranks meet).

use super::*;
use c10d::{Backend, ProcessGroup, ReduceOp, Store};
use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RResult, RSlice},
    },
    Collectives, CollectivesBox, Collectives_TO, PluginError, TensorHandle,
};
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Mutex,
};
use std::time::Instant;

/// The store key the lead of replica `index` beats (its rank in the leads' group).
pub fn lead_beat_key(index: usize) -> String {
    beat_key(index)
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
    /// Each group rank's rank in the world (the leads' when target replicas span several ranks).
    global: Vec<usize>,
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
        // Say first that this rank is stopping on a peer's failure, so that a rank diagnosing
        // later does not name it as gone too once it has exited.
        let _ = self.store.lock().expect("store lock").add(&stopping_key(me), 1);
        let gone = self.gone_ranks();
        if me == 0 {
            // Rank 0 serves the store: stay a little, so the others' diagnosis can still read it.
            std::thread::sleep(HEARTBEAT * (MISSED_BEATS + 2));
        }
        match gone {
            Ok(gone) if !gone.is_empty() => {
                let who: Vec<String> = gone.iter().map(|&r| self.global[r].to_string()).collect();
                let s = if gone.len() > 1 { "s" } else { "" };
                anyhow!(
                    "rank{s} {} gone (no heartbeat for {} s): {what} failed on rank {}: {e}",
                    who.join(", "),
                    MISSED_BEATS,
                    self.global[me]
                )
            }
            Ok(_) => anyhow!(
                "{what} failed on rank {} with no rank gone (one may be stuck; timeout {} s): {e}",
                self.global[me],
                self.timeout.as_secs()
            ),
            Err(store) => anyhow!(
                "rank 0 gone (the rendezvous store it serves does not answer: {store}): {what} failed on rank {}: {e}",
                self.global[me]
            ),
        }
    }

    /// The ranks whose heartbeat stopped (counters read, then again after a few beats), less
    /// those that were stopping on a failure of their own diagnosis.
    fn gone_ranks(&self) -> c10d::Result<Vec<usize>> {
        let store = self.store.lock().expect("store lock");
        let read = |key: fn(usize) -> String| {
            (0..self.world).map(|r| store.add(&key(r), 0)).collect::<c10d::Result<Vec<i64>>>()
        };
        let before = read(beat_key)?;
        std::thread::sleep(HEARTBEAT * MISSED_BEATS);
        let after = read(beat_key)?;
        let stopping = read(stopping_key)?;
        Ok((0..self.world).filter(|&r| r != self.rank && after[r] == before[r] && stopping[r] == 0).collect())
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

pub(super) fn beat_key(rank: usize) -> String {
    format!("dflash/beat/{rank}")
}

fn stopping_key(rank: usize) -> String {
    format!("dflash/stopping/{rank}")
}

/// The data-parallel communicator on c10d.
pub struct C10dCommunicator {
    shared: Arc<Shared>,
    bucket_bytes: usize,
}

impl C10dCommunicator {
    /// Meet the other ranks through rank 0's store (see `rendezvous`: this run's ranks, each
    /// claimed once, with the same world, config and build), and make the process group: Gloo when `device` is the CPU, NCCL on a CUDA device.
    pub fn connect(env: &DistEnv, device: Device, identity: &Identity) -> Result<Self> {
        let (store, addr) = super::rendezvous::meet(env, identity)?;
        Self::with_group(env, device, store, &addr, env.rank, (0..env.world).collect())
    }

    /// With target replicas of several ranks (`replica.rs`): every rank meets the others, then
    /// the replicas' leads make the data-parallel group (a replica's index its rank in it); each
    /// rank also gets a store client of its own (for its replica's target calls).
    pub fn connect_replicas(
        env: &DistEnv,
        device: Device,
        identity: &Identity,
        layout: &super::replica::Layout,
    ) -> Result<(Option<Self>, Store)> {
        let (store, addr) = super::rendezvous::meet(env, identity)?;
        let client = store.another().map_err(|e| anyhow!("rank {}: a second store client: {e}", env.rank))?;
        if !layout.is_lead() {
            return Ok((None, store));
        }
        // Rank 0's store (which serves the others) goes with the target calls, which end last:
        // their end waits until every other rank has read it (`replica::Lead`).
        let leads = (0..layout.count).map(|i| layout.lead_of(i)).collect();
        Ok((Some(Self::with_group(env, device, client, &addr, layout.index, leads)?), store))
    }

    /// The group of the ranks `global` (this one `rank` of them), and the heartbeat that names a
    /// rank that dies.
    fn with_group(
        env: &DistEnv,
        device: Device,
        store: Store,
        addr: &str,
        rank: usize,
        global: Vec<usize>,
    ) -> Result<Self> {
        let (world, timeout) = (global.len(), env.timeout);
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
            global,
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
