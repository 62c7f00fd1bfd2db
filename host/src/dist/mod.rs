//! Data-parallel replicas of the whole pipeline: each rank runs its own targets and drafter on
//! its share of every step's micro-batches, and the drafter gradients are summed across ranks
//! before clipping, so R replicas with K micro-batches each take the step one replica takes with
//! R x K.
//!
//! Ranks meet through the launchers' environment (torchrun, Slurm, `train --nproc N`): `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. The transport is libtorch's c10d
//! (crates/c10d): a `TCPStore` served by rank 0 for the rendezvous, Gloo for CPU replicas, NCCL
//! for CUDA ones. At the rendezvous (rendezvous.rs) each rank shows it belongs to this run and
//! claims its rank once, and the ranks compare their world size, config and build, refusing to
//! start with a line naming the rank and the config field that differ. A rank that dies or stops answering
//! turns every other rank's next collective into an error naming it (each rank beats a counter
//! in the store; the rank whose counter stopped is the one named), never a hang.

use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    tch::{Device, Tensor},
    CollectivesBox,
};
use std::time::Duration;

pub mod group;
pub mod launch;
mod rendezvous;
pub mod replica;

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
    /// What tells this run's ranks from another's at the rendezvous: `DFLASH_RUN_TOKEN`, else
    /// torchrun's `TORCHELASTIC_RUN_ID` (not `none`); None: one is made from the experiment
    /// folder.
    pub run_token: Option<String>,
}

impl DistEnv {
    /// From the launcher's variables; None when `WORLD_SIZE` is unset.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let num = |k: &str| -> Result<Option<usize>> {
            var(k)
                .map(|v| {
                    v.trim().parse::<usize>().with_context(|| format!("environment variable {k}=`{v}`: not a number"))
                })
                .transpose()
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
            master_port: master_port
                .trim()
                .parse()
                .with_context(|| format!("MASTER_PORT=`{master_port}`: not a port"))?,
            timeout,
            run_token: var("DFLASH_RUN_TOKEN")
                .or_else(|| var("TORCHELASTIC_RUN_ID").filter(|id| id != "none"))
                .filter(|t| !t.is_empty()),
        }))
    }
}

/// NVLink multicast (NVLS) off unless the user chose: it can take a host's GPUs, which others
/// may share, out of service; and libtorch's flight recorder off (see c10d). Call before any
/// thread starts (it sets environment variables).
pub fn set_nccl_defaults() {
    c10d::flight_recorder_off_by_default();
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}

/// What ranks must agree on to train together: the resolved config (without device placement,
/// which is each rank's own; its text, to name a field that differs, and its hash) and the build
/// (a hash of the binary and plugin libraries); and the experiment folder, from which a run token
/// is made when the launcher gives none.
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    pub config: String,
    pub config_text: String,
    pub build: String,
    pub experiment: String,
}

impl Identity {
    pub fn new(config_text: String, build: String, experiment: String) -> Self {
        use sha2::{Digest, Sha256};
        let config = Sha256::digest(config_text.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect();
        Self { config, config_text, build, experiment }
    }
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
    use super::group::C10dCommunicator;
    use super::*;
    use plugin_api::{tch::Kind, TensorHandle};
    use std::time::Instant;

    #[test]
    fn the_launcher_environment_is_read_and_checked() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(
            DistEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_PORT", "2")]))
                .unwrap()
                .map(|e| e.world),
            Some(1)
        );
        let env = DistEnv::from_vars(vars(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (env.rank, env.world, env.local_rank, env.master_addr.as_str(), env.master_port),
            (2, 4, 0, "node0", 29500)
        );
        assert_eq!(env.timeout, DEFAULT_TIMEOUT);
        let env = DistEnv::from_vars(vars(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("MASTER_PORT", "1"),
            ("DFLASH_DIST_TIMEOUT", "20"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(env.timeout, Duration::from_secs(20));
        let err = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_PORT", "1")])).unwrap_err();
        assert!(err.to_string().contains("RANK 2 is not below WORLD_SIZE 2"), "{err}");
        let err = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "x")])).unwrap_err();
        assert!(err.to_string().contains("RANK=`x`"), "{err}");
        assert!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "1")]))
            .unwrap_err()
            .to_string()
            .contains("MASTER_PORT"));
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn env(rank: usize, world: usize, port: u16, timeout_s: u64) -> DistEnv {
        DistEnv {
            rank,
            world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            timeout: Duration::from_secs(timeout_s),
            run_token: Some("run".into()),
        }
    }

    /// One process per `envs` entry, on threads, each connecting with `identity(i)` and running `f`.
    fn processes<T: Send>(
        envs: &[DistEnv],
        identity: impl Fn(usize) -> Identity + Sync,
        f: impl Fn(&mut C10dCommunicator) -> T + Sync,
    ) -> Vec<Result<T>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = envs
                .iter()
                .enumerate()
                .map(|(i, env)| {
                    let (f, identity) = (&f, &identity);
                    s.spawn(move || C10dCommunicator::connect(env, Device::Cpu, &identity(i)).map(|mut c| f(&mut c)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// `world` ranks on threads, each connecting with `identity(rank)` and running `f`.
    fn ranks<T: Send>(
        world: usize,
        identity: impl Fn(usize) -> Identity + Sync,
        f: impl Fn(&mut C10dCommunicator) -> T + Sync,
    ) -> Vec<Result<T>> {
        let port = free_port();
        processes(&(0..world).map(|r| env(r, world, port, 20)).collect::<Vec<_>>(), identity, f)
    }

    fn same(_: usize) -> Identity {
        Identity::new("seed = 1".into(), "b".into(), "exp".into())
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
            lent.all_gather(handles.as_slice().into(), &TensorHandle::new(Tensor::from_slice(&[c.rank() as i64, 7])))
                .unwrap();
            c.barrier().unwrap();
            let v = |t: &Tensor| Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap();
            (
                sums,
                ts.iter().map(v).collect::<Vec<_>>(),
                v(&p.grad()),
                v(&p.detach()),
                outs.iter().map(v).collect::<Vec<_>>(),
            )
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
    /// names it and the field that differs; another build, by its hash.
    #[test]
    fn a_rank_with_another_config_is_named_at_the_rendezvous_with_the_field() {
        let config = |r: usize| format!("seed = 1\n[optimizer]\nlr = {}\n", if r == 2 { "0.01" } else { "0.003" });
        let out = ranks(3, |r| Identity::new(config(r), "b".into(), "exp".into()), |_| ());
        for o in out {
            let e = format!("{:#}", o.unwrap_err());
            assert_eq!(
                e,
                "rank 2 differs from rank 0 in its config: optimizer.lr = 0.01 vs 0.003 on rank 0; every rank must run the same build with the same config"
            );
        }
        let out = ranks(2, |r| Identity::new("seed = 1".into(), format!("b{r}"), "exp".into()), |_| ());
        for o in out {
            let e = format!("{:#}", o.unwrap_err());
            assert!(e.starts_with("rank 1 differs from rank 0: build b1 vs build b0 on rank 0"), "{e}");
        }
    }

    /// A second process claiming a rank is refused at once, naming the rank and its holder; the
    /// run goes on with the first.
    #[test]
    fn a_second_claim_of_a_rank_is_refused_at_once_naming_the_holder() {
        let port = free_port();
        let envs = [env(0, 2, port, 20), env(1, 2, port, 20), env(1, 2, port, 20)];
        let t = Instant::now();
        // The run goes on a while (rank 0's store with it), as a training run does.
        let out = processes(&envs, same, |c| {
            std::thread::sleep(Duration::from_secs(3));
            c.rank()
        });
        assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
        assert_eq!(out[0].as_ref().ok(), Some(&0));
        let (ok, refused): (Vec<_>, Vec<_>) = out[1..].iter().partition(|o| o.is_ok());
        assert_eq!(ok.len(), 1, "{out:?}");
        let e = format!("{:#}", refused[0].as_ref().unwrap_err());
        let holder = format!("pid {} on ", std::process::id());
        assert!(e.starts_with("rank 1 is taken: ") && e.contains(&holder) && e.contains("own RANK"), "{e}");
    }

    /// A rank of another run (another token) that reaches this run's store is refused, and a
    /// rank 0 whose port is taken names what holds it.
    #[test]
    fn a_rank_of_another_run_is_refused_and_a_taken_port_is_named() {
        let port = free_port();
        let mut stranger = env(1, 2, port, 2);
        stranger.run_token = Some("another".into());
        let mut twin = env(0, 2, port, 2);
        twin.run_token = Some("another".into());
        let out = processes(&[env(0, 2, port, 2), stranger], same, |_| ());
        let e = format!("{:#}", out[1].as_ref().err().unwrap());
        assert!(e.contains(&format!("the rendezvous store at 127.0.0.1:{port} serves another run")), "{e}");
        let e = format!("{:#}", out[0].as_ref().err().unwrap());
        assert!(e.starts_with("rank 1 did not join the rendezvous"), "{e}");
        // The port held by a program that is no store.
        let held = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        let e = format!("{:#}", C10dCommunicator::connect(&twin, Device::Cpu, &same(0)).err().unwrap());
        assert!(e.contains(&format!("MASTER_PORT {port} on 127.0.0.1 is in use by another program")), "{e}");
        drop(held);
    }

    /// The sockets listening on `port`, by local address as /proc/net/tcp and tcp6 write it
    /// (`0100007F:PORT` is 127.0.0.1, all zeros every interface).
    fn listening_on(port: u16) -> Vec<String> {
        let mut found = Vec::new();
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
                let cols: Vec<&str> = line.split_whitespace().collect();
                if cols.len() > 3 && cols[3] == "0A" && cols[1].ends_with(&format!(":{port:04X}")) {
                    found.push(cols[1].to_string());
                }
            }
        }
        found
    }

    /// A rank that never comes: the others stop after the timeout, naming it. Meanwhile rank 0,
    /// with MASTER_ADDR 127.0.0.1 or localhost, serves its store on the loopback only.
    #[test]
    fn a_missing_rank_is_named_after_the_timeout_and_the_store_listens_where_master_addr_says() {
        for addr in ["127.0.0.1", "localhost"] {
            let mut env = env(0, 2, free_port(), 2);
            env.master_addr = addr.into();
            let port = env.master_port;
            let t = Instant::now();
            let (e, listening) = std::thread::scope(|s| {
                let rank0 = s.spawn(|| C10dCommunicator::connect(&env, Device::Cpu, &same(0)).err());
                let mut listening = Vec::new();
                while listening.is_empty() && !rank0.is_finished() {
                    listening = listening_on(port);
                    std::thread::sleep(Duration::from_millis(10));
                }
                (format!("{:#}", rank0.join().unwrap().expect("rank 1 never came")), listening)
            });
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            assert!(e.starts_with("rank 1 did not join the rendezvous"), "{e}");
            assert_eq!(listening, vec![format!("0100007F:{port:04X}")], "MASTER_ADDR {addr}");
        }
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
        assert_eq!(
            rank_devices(&s(&["cuda:0", "cuda:1", "cuda:2", "cuda:3"]), 1, 8).unwrap(),
            s(&["cuda:4", "cuda:5", "cuda:6", "cuda:7"])
        );
        assert_eq!(rank_devices(&s(&["cpu"]), 2, 0).unwrap(), s(&["cpu"]));
        // Slurm's per-task CUDA_VISIBLE_DEVICES: each rank sees one GPU, already its own.
        assert_eq!(rank_devices(&s(&["cuda:0"]), 5, 1).unwrap(), s(&["cuda:0"]));
        let e = rank_devices(&s(&["cuda:0", "cuda:1"]), 2, 5).unwrap_err().to_string();
        assert!(e.contains("local rank 2 needs cuda:4..cuda:5"), "{e}");
    }
}
