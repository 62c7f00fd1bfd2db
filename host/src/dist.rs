//! Data-parallel replicas of the whole pipeline: each rank runs its own targets and drafter on
//! its share of every step's micro-batches, and the drafter gradients are averaged across ranks
//! before clipping, so R replicas with K micro-batches each take the step one replica takes with
//! R x K.
//!
//! Ranks meet through the launchers' environment (torchrun, Slurm): `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. The communicator here is TCP through rank 0 (a
//! star: deterministic summation order, fine for CPU runs and tests); an NCCL communicator for
//! GPU replicas implements the same trait (docs/DISTRIBUTED.md says what is and is not done).

use anyhow::{bail, Context, Result};
use plugin_api::tch::{Device, Kind, Tensor};
use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    time::{Duration, Instant},
};

/// Where this process sits among the replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct DistEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// From the launcher's variables; None when `WORLD_SIZE` is unset or 1.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let num = |k: &str| -> Result<Option<usize>> {
            var(k).map(|v| v.trim().parse::<usize>().with_context(|| format!("environment variable {k}=`{v}`: not a number"))).transpose()
        };
        let world = num("WORLD_SIZE")?.unwrap_or(1);
        if world <= 1 {
            return Ok(None);
        }
        let rank = num("RANK")?.context("WORLD_SIZE is set but RANK is not")?;
        if rank >= world {
            bail!("RANK {rank} is not below WORLD_SIZE {world}");
        }
        let master_port = var("MASTER_PORT").context("WORLD_SIZE > 1 needs MASTER_PORT")?;
        Ok(Some(Self {
            rank,
            world,
            local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
            master_addr: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port: master_port.trim().parse().with_context(|| format!("MASTER_PORT=`{master_port}`: not a port"))?,
        }))
    }
}

/// Collectives the trainer needs.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Element-wise sum across ranks, in place, in rank order (every rank gets the same bits).
    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<()>;
    /// Mean of f32 buffers across ranks, in place.
    fn all_reduce_mean_f32(&mut self, values: &mut [f32]) -> Result<()>;
}

/// Average the gradients of `params` across ranks (one flat f32 buffer, one round trip).
pub fn average_gradients(comm: &mut dyn Communicator, params: &[Tensor]) -> Result<()> {
    let _guard = plugin_api::tch::no_grad_guard();
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
    let defined: Vec<&Tensor> = grads.iter().filter(|g| g.defined()).collect();
    if defined.len() != grads.len() {
        bail!("{} of {} drafter parameters have no gradient; every rank must have all of them", grads.len() - defined.len(), grads.len());
    }
    let flat = Tensor::cat(&defined.iter().map(|g| g.to_device(Device::Cpu).to_kind(Kind::Float).flatten(0, -1)).collect::<Vec<_>>(), 0);
    let mut buf: Vec<f32> = Vec::try_from(&flat)?;
    comm.all_reduce_mean_f32(&mut buf)?;
    let mean = Tensor::from_slice(&buf);
    let mut offset = 0;
    for g in defined {
        let n = g.numel() as i64;
        let part = mean.narrow(0, offset, n).view(g.size().as_slice()).to_kind(g.kind()).to_device(g.device());
        g.shallow_clone().copy_(&part);
        offset += n;
    }
    Ok(())
}

/// TCP through rank 0: every other rank holds one connection to it.
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    /// Rank 0: the connections of ranks 1..world, in rank order; others: the one to rank 0.
    peers: Vec<TcpStream>,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(300);

impl TcpCommunicator {
    pub fn connect(env: &DistEnv) -> Result<Self> {
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        let peers = if env.rank == 0 {
            let listener = TcpListener::bind(&addr).with_context(|| format!("rank 0: listening on {addr}"))?;
            let mut slots: Vec<Option<TcpStream>> = (1..env.world).map(|_| None).collect();
            for _ in 1..env.world {
                let (mut s, _) = listener.accept().with_context(|| format!("rank 0: accepting on {addr}"))?;
                let r = read_u64(&mut s)? as usize;
                if r == 0 || r >= env.world || slots[r - 1].is_some() {
                    bail!("rank 0: a peer announced rank {r} (world {})", env.world);
                }
                slots[r - 1] = Some(s);
            }
            slots.into_iter().map(|s| s.expect("every rank connected")).collect()
        } else {
            let started = Instant::now();
            let mut s = loop {
                match TcpStream::connect(&addr) {
                    Ok(s) => break s,
                    Err(e) if started.elapsed() < CONNECT_TIMEOUT => {
                        tracing::debug!("rank {}: waiting for rank 0 at {addr}: {e}", env.rank);
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    Err(e) => bail!("rank {}: could not reach rank 0 at {addr} within {CONNECT_TIMEOUT:?}: {e}", env.rank),
                }
            };
            s.write_all(&(env.rank as u64).to_le_bytes())?;
            vec![s]
        };
        for p in &peers {
            p.set_nodelay(true)?;
        }
        tracing::info!("rank {} of {}: connected through {addr}", env.rank, env.world);
        Ok(Self { rank: env.rank, world: env.world, peers })
    }

    /// Sum `bytes` (a buffer of `T`) across ranks with `add`, then hand the result to everyone.
    fn reduce<T: Copy>(&mut self, values: &mut [T], add: impl Fn(&mut T, T), finish: impl Fn(&mut [T])) -> Result<()> {
        let size = std::mem::size_of_val(values);
        if self.rank == 0 {
            let mut incoming = vec![0u8; size];
            for (i, p) in self.peers.iter_mut().enumerate() {
                p.read_exact(&mut incoming).with_context(|| format!("rank 0: receiving from rank {}", i + 1))?;
                // SAFETY: `incoming` holds exactly `values.len()` plain values written by a peer
                // of the same build (same T); read unaligned.
                for (j, v) in values.iter_mut().enumerate() {
                    let x = unsafe { std::ptr::read_unaligned((incoming.as_ptr() as *const T).add(j)) };
                    add(v, x);
                }
            }
            finish(values);
            // SAFETY: viewing plain values as bytes to send them.
            let out = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, size) };
            for p in &mut self.peers {
                p.write_all(out)?;
            }
        } else {
            let p = &mut self.peers[0];
            // SAFETY: as above.
            let out = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, size) };
            p.write_all(out).with_context(|| format!("rank {}: sending to rank 0", self.rank))?;
            let back = unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, size) };
            p.read_exact(back).with_context(|| format!("rank {}: receiving from rank 0", self.rank))?;
        }
        Ok(())
    }
}

fn read_u64(s: &mut TcpStream) -> Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<()> {
        self.reduce(values, |a, b| *a += b, |_| {})
    }

    fn all_reduce_mean_f32(&mut self, values: &mut [f32]) -> Result<()> {
        let world = self.world as f32;
        self.reduce(values, |a, b| *a += b, |v| v.iter_mut().for_each(|x| *x /= world))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launcher_environment_is_read_and_checked() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "0")])).unwrap(), None);
        let env = DistEnv::from_vars(vars(&[("WORLD_SIZE", "4"), ("RANK", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")]))
            .unwrap()
            .unwrap();
        assert_eq!((env.rank, env.world, env.local_rank, env.master_addr.as_str(), env.master_port), (2, 4, 0, "node0", 29500));
        let err = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_PORT", "1")])).unwrap_err();
        assert!(err.to_string().contains("RANK 2 is not below WORLD_SIZE 2"), "{err}");
        let err = DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "x")])).unwrap_err();
        assert!(err.to_string().contains("RANK=`x`"), "{err}");
        assert!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "1")])).unwrap_err().to_string().contains("MASTER_PORT"));
    }

    #[test]
    fn three_ranks_on_threads_sum_and_average_in_rank_order() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let results: Vec<(Vec<f64>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        let env = DistEnv { rank, world: 3, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port };
                        let mut c = TcpCommunicator::connect(&env).unwrap();
                        let mut sums = vec![rank as f64, 1.0, 0.1 * rank as f64];
                        c.all_reduce_sum(&mut sums).unwrap();
                        let mut means = vec![rank as f32 * 3.0, 6.0];
                        c.all_reduce_mean_f32(&mut means).unwrap();
                        (sums, means)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sums, means) in &results {
            assert_eq!(sums, &vec![3.0, 3.0, (0.0 + 0.1) + 0.2]);
            assert_eq!(means, &vec![3.0, 6.0]);
        }
    }
}
