//! `bench train` of a target spread over the ranks of one replica (`[target] tensor_parallel =
//! T`, under `--nproc T` or a launcher): the lead (rank 0) runs every phase, its target posting
//! each call for the other ranks; they build their part of the target alone, serve its calls,
//! and at the end post what they used, which the lead's report lists rank by rank.

use crate::{
    dist::{
        self,
        group::C10dCommunicator,
        replica::{self, Layout},
        DistEnv, Identity,
    },
    plugins::handles::TargetHandle,
};
use anyhow::{anyhow, Result};
use c10d::Store;
use plugin_api::tch::Device;
use serde::{Deserialize, Serialize};

/// What one rank of the replica held and ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankFigures {
    pub rank: usize,
    pub device: String,
    /// Device memory in use once its plugins were built (GiB; None on the CPU): the lead's
    /// includes the drafter and its optimizer state.
    pub built_mem_gib: Option<f64>,
    /// Device memory in use after the last phase (GiB; None on the CPU).
    pub mem_gib: Option<f64>,
    /// Target calls it ran for the lead (0 on the lead, which makes them).
    pub served_calls: u64,
}

/// This rank's device: the config's, a CUDA index offset by the local rank (`cuda:0` on local
/// rank r is `cuda:r`).
pub fn device(configured: &str) -> Result<String> {
    let given = [configured.to_string()];
    Ok(crate::pipeline::ranks::rank_devices(&given)?.map_or_else(|| configured.to_string(), |(_, mut d)| d.remove(0)))
}

/// What the replica's ranks compare when they meet: the bench config (without the device each
/// rank offsets) and this binary's hash, as training ranks do.
pub fn identity(table: &toml::Table, config: &std::path::Path) -> Result<Identity> {
    let mut table = table.clone();
    table.remove("device");
    let build = crate::pipeline::ranks::build_id(&[])?;
    Ok(Identity::new(toml::to_string(&table)?, build, config.display().to_string()))
}

fn key(rank: usize) -> String {
    format!("dflash/bench/rank/{rank}")
}

/// A rank other than the lead: serve the lead's target calls, then post this rank's figures.
pub fn serve(
    mut target: TargetHandle,
    (env, layout): (&DistEnv, &Layout),
    (device, device_name): (Device, &str),
    identity: &Identity,
    built_mem_gib: Option<f64>,
) -> Result<u64> {
    let (_, store) = C10dCommunicator::connect_replicas(env, device, identity, layout)?;
    tracing::info!("rank {}: serving the target of the benchmarked replica", env.rank);
    let beat = dist::group::lead_beat_key(layout.index);
    let calls = replica::serve_then(&mut target, layout, store, &beat, |store, calls| {
        let figures = RankFigures {
            rank: env.rank,
            device: device_name.to_string(),
            built_mem_gib,
            mem_gib: super::memory::mem(device),
            served_calls: calls,
        };
        let bytes = serde_json::to_vec(&figures)?;
        store.set(&key(env.rank), &bytes).map_err(|e| anyhow!("rank {}: posting its figures: {e}", env.rank))
    })?;
    tracing::info!("rank {}: served {calls} target calls", env.rank);
    Ok(calls)
}

/// The lead's hold on its replica: the communicator (whose heartbeat the other ranks watch) and
/// the store they post their figures in.
pub struct Held {
    _comm: C10dCommunicator,
    store: Store,
    layout: Layout,
}

/// The lead's target, posting each call for the replica's other ranks.
pub fn lead(
    target: TargetHandle,
    (env, layout): (&DistEnv, &Layout),
    device: Device,
    identity: &Identity,
) -> Result<(TargetHandle, Held)> {
    let (comm, store) = C10dCommunicator::connect_replicas(env, device, identity, layout)?;
    let comm = comm.ok_or_else(|| anyhow!("rank {}: bench train runs on the replica's lead only", env.rank))?;
    let calls = store.another().map_err(|e| anyhow!("rank {}: a second store client: {e}", env.rank))?;
    let target = replica::lead(target, layout, calls);
    Ok((target, Held { _comm: comm, store, layout: *layout }))
}

impl Held {
    /// The other ranks' figures, once `target` (the lead's) is dropped: that ends the run, and
    /// each rank posts its figures before it says it has read the end.
    pub fn figures(self, target: TargetHandle) -> Result<Vec<RankFigures>> {
        drop(target);
        (1..self.layout.size)
            .map(|rank| {
                let bytes = self.store.get(&key(rank)).map_err(|e| anyhow!("rank {rank}'s figures: {e}"))?;
                Ok(serde_json::from_slice(&bytes)?)
            })
            .collect()
    }
}
