//! `bench allreduce`: the data-parallel gradient all-reduce (dist.rs, on c10d) timed on the
//! gradients of a bench config's drafter (random values of its parameters' shapes and dtype),
//! for a few bucket sizes, plus the step's small f64 all-reduce.
//!
//! Run as one rank of a launcher (`dflash-host train --nproc`-style variables, or torchrun) or
//! alone: alone it makes a world of 1, where the time is c10d's and NCCL's fixed cost per call
//! plus a device-local copy, not a network's.

use super::train::{plugin_name, section, BenchConfig};
use crate::{
    dist::{group::C10dCommunicator, Communicator, DistEnv, Identity},
    plugins::{
        handles::{DrafterHandle, TargetHandle},
        Registry,
    },
};
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_stable::std_types::RSome,
    tch::{self, Device, Tensor},
    HostContext, PluginInstance, PluginKind,
};
use serde::Serialize;
use std::{path::Path, time::Instant};

#[derive(Debug, Serialize)]
pub struct BucketTime {
    pub bucket_mb: usize,
    pub buckets: usize,
    /// Mean over the timed iterations, the device synchronised after each.
    pub ms: f64,
    /// Gradient bytes / time (what torch calls algorithm bandwidth).
    pub gb_per_s: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub backend: String,
    pub world: usize,
    pub device: String,
    pub tensors: usize,
    pub params: usize,
    pub bytes: usize,
    pub dtype: String,
    pub iters: usize,
    pub buckets: Vec<BucketTime>,
    /// The step's sums (loss, tokens, counts: 2 + 2 x block size f64 values).
    pub small_f64_ms: f64,
}

pub fn allreduce(registry: &Registry, config_path: &Path, bucket_mb: &[usize], iters: usize) -> Result<Report> {
    let text = std::fs::read_to_string(config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let cfg: BenchConfig = toml::from_str(&text).with_context(|| format!("{}", config_path.display()))?;
    let dtype = cfg.dtype.clone().unwrap_or_else(|| if cfg.device == "cpu" { "f32" } else { "bf16" }.into());
    if cfg.device.starts_with("cuda") && !crate::environment::enable_cuda() {
        bail!("device `{}` asked for, but libtorch's CUDA libraries could not be loaded", cfg.device);
    }
    let config_dir = config_path.parent().unwrap_or(Path::new("."));
    let mut ctx =
        crate::plugins::host_context(&cfg.device, &dtype, cfg.seed, config_dir, &crate::environment::cache_dir());
    let device = ctx.tch_device().map_err(|e| anyhow!("{e}"))?;
    tch::manual_seed(cfg.seed as i64);

    // 1. The drafter (the target only for its facts; dropped before timing).
    let create = |kind: PluginKind, table: &toml::Table, ctx: &HostContext| -> Result<PluginInstance> {
        Ok(registry.create(kind, &section(kind.as_str(), table)?, ctx)?.0)
    };
    let spec = match create(PluginKind::Target, &cfg.target, &ctx)? {
        PluginInstance::Target(t) => TargetHandle::new(t, &plugin_name(&cfg.target)).spec()?,
        _ => bail!("[target] made no target"),
    };
    ctx.target = RSome(spec);
    let PluginInstance::Drafter(drafter) = create(PluginKind::Drafter, &cfg.drafter, &ctx)? else {
        bail!("[drafter] made no drafter")
    };
    let drafter = DrafterHandle::new(drafter, &plugin_name(&cfg.drafter));
    let grads: Vec<Tensor> = drafter.parameters()?.iter().map(|nt| nt.tensor.tensor().randn_like()).collect();
    let bytes: usize = grads.iter().map(|g| g.numel() * g.kind().elt_size_in_bytes()).sum();

    // 2. The communicator: the launcher's world, or a world of 1.
    let env = match DistEnv::from_env()? {
        Some(env) => env,
        None => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            DistEnv {
                rank: 0,
                world: 1,
                local_rank: 0,
                master_addr: "127.0.0.1".into(),
                master_port: port,
                timeout: crate::dist::DEFAULT_TIMEOUT,
                run_token: None,
            }
        }
    };
    let mut comm =
        C10dCommunicator::connect(&env, device, &Identity::new("bench".into(), "bench".into(), "bench".into()))?;
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };

    // 3. Each bucket size: warm-up, then the mean of `iters`.
    let mut times = Vec::new();
    for &mb in bucket_mb {
        comm.set_bucket_bytes(mb << 20);
        for _ in 0..2 {
            comm.all_reduce_sum_tensors(&grads)?;
        }
        sync();
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce_sum_tensors(&grads)?;
            sync();
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
        let buckets = crate::dist::buckets(&grads, mb << 20).len();
        times.push(BucketTime { bucket_mb: mb, buckets, ms, gb_per_s: bytes as f64 / (ms * 1e-3) / 1e9 });
    }
    let mut small = vec![1.0f64; 34];
    comm.all_reduce_sum(&mut small)?;
    let t = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_sum(&mut small)?;
    }
    let small_f64_ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
    Ok(Report {
        backend: comm.backend().name().into(),
        world: comm.world(),
        device: cfg.device.clone(),
        tensors: grads.len(),
        params: grads.iter().map(|g| g.numel()).sum(),
        bytes,
        dtype,
        iters,
        buckets: times,
        small_f64_ms,
    })
}

pub fn print(r: &Report) {
    crate::say!(
        "all-reduce of {} gradients ({:.1}M {} values, {:.2} GB) over {} rank(s), {} on {}",
        r.tensors,
        r.params as f64 / 1e6,
        r.dtype,
        r.bytes as f64 / 1e9,
        r.world,
        r.backend,
        r.device
    );
    crate::say!("{:>10} {:>8} {:>10} {:>10}", "bucket MB", "buckets", "ms", "GB/s");
    for b in &r.buckets {
        crate::say!("{:>10} {:>8} {:>10.3} {:>10.1}", b.bucket_mb, b.buckets, b.ms, b.gb_per_s);
    }
    crate::say!("step sums (34 f64): {:.3} ms", r.small_f64_ms);
}
