//! The ranks of a target replica spread over several ranks (`[target] tensor_parallel = T`, under
//! a launcher): its lead builds every component and runs the command; each other rank builds the
//! target alone and serves the lead's target calls until it ends (`dist::replica`).

use crate::{
    config::{self, RunConfig},
    dist::{
        self,
        group::C10dCommunicator,
        replica::{self, Layout},
        DistEnv,
    },
    pipeline::{assemble::build_target, components::Components},
    plugins::Registry,
};
use anyhow::{bail, Result};
use std::path::Path;

/// This rank's place in its replica (`target`: the config's [target]), under a launcher with
/// `tensor_parallel` > 1.
pub fn layout(target: &toml::Table) -> Result<Option<(DistEnv, Layout)>> {
    let env = DistEnv::from_env()?;
    Ok(Layout::of(target, env.as_ref())?.map(|l| (env.expect("a layout comes with a launcher"), l)))
}

/// This rank's place when it only serves its replica's target (not the lead).
pub fn follower(cfg: &RunConfig) -> Result<Option<(DistEnv, Layout)>> {
    Ok(layout(&cfg.target)?.filter(|(_, l)| !l.is_lead()))
}

/// `what` (eval, distill, capture, bench train) drives one replica: its world must be one
/// replica's ranks (one rank when the target runs whole).
pub fn one_replica(target: &toml::Table, what: &str) -> Result<Option<(DistEnv, Layout)>> {
    let found = layout(target)?;
    if found.is_none() {
        if let Some(env) = DistEnv::from_env()?.filter(|e| e.world > 1) {
            bail!(
                "{what} runs in one process with [target] `tensor_parallel` = 1, not over WORLD_SIZE {} (drop \
                 `--nproc`)",
                env.world
            );
        }
    }
    if let Some((env, l)) = &found {
        if l.count != 1 {
            bail!(
                "{what} runs one target replica: launch it over [target] `tensor_parallel` = {} ranks (`--nproc {}`), \
                 not WORLD_SIZE {}",
                l.size,
                l.size,
                env.world
            );
        }
    }
    Ok(found)
}

/// Build the target alone, meet the other ranks (`name`: the run they compare at the
/// rendezvous), and serve the lead's target calls until it ends; how many were served.
pub fn serve(
    cfg: &RunConfig,
    config_path: &Path,
    config_dir: &Path,
    registry: &Registry,
    name: &Path,
    (env, layout): (DistEnv, Layout),
) -> Result<u64> {
    let (mut target, records) = build_target(cfg, config_path, config_dir, registry)?;
    tracing::info!(
        "rank {}: serving the target of replica {} (no drafter, optimizer or data on this rank)",
        env.rank,
        layout.index
    );
    let identity = super::ranks::identity(cfg, &records, name)?;
    let device = config::parse_device(cfg.drafter_device())?;
    let (_, store) = C10dCommunicator::connect_replicas(&env, device, &identity, &layout)?;
    let calls = replica::serve(&mut target, &layout, store, &dist::group::lead_beat_key(layout.index))?;
    tracing::info!("rank {}: served {calls} target calls of replica {}", env.rank, layout.index);
    Ok(calls)
}

/// The lead of the one replica `what` (eval, distill, capture) runs: its target posts every call for the
/// replica's other ranks. The communicator beats the heartbeat they watch: hold it until the
/// components are gone. Without a replica, the components as they were.
pub fn drive(
    cfg: &RunConfig,
    components: Components,
    name: &Path,
    what: &str,
) -> Result<(Components, Option<C10dCommunicator>)> {
    let Some((env, layout)) = one_replica(&cfg.target, what)? else { return Ok((components, None)) };
    let identity = super::ranks::identity(cfg, &components.records, name)?;
    let device = config::parse_device(cfg.drafter_device())?;
    let (comm, store) = C10dCommunicator::connect_replicas(&env, device, &identity, &layout)?;
    let Some(comm) = comm else { bail!("rank {}: {what} runs on the replica's lead only", env.rank) };
    let Components { target, extra_targets, drafter, optimizer, data, records, numerics, mask_token } = components;
    let target = replica::lead(target, &layout, store);
    Ok((Components { target, extra_targets, drafter, optimizer, data, records, numerics, mask_token }, Some(comm)))
}
