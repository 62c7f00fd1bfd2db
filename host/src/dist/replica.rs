//! Target replicas spread over several ranks (`[target] tensor_parallel = T`): the world's ranks
//! form replicas of T consecutive ranks (ranks 0..T the first, T..2T the second, ...). Each
//! replica's ranks hold their part of the target and run every target call together (the target
//! plugin's own c10d group, through the store rank 0 serves); the first rank of a replica, its
//! lead, trains: it runs the pipeline as a data-parallel rank does (its replica's features feed its
//! drafter once), and the leads' gradients are summed. The other ranks only serve the target: the
//! lead posts each target call (forward, generate, the decoding cache) in the store, and they run
//! it with the same arguments.

use super::DistEnv;
use crate::plugins::handles::TargetHandle;
use anyhow::{anyhow, bail, Result};
use c10d::Store;
use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{RErr, RResult, RSlice, RString, RVec},
    },
    tch::{Kind, Tensor},
    PluginError, ReplicaGroup, TargetBox, TargetModel, TargetModel_TO, TargetOutput, TargetSpec, TensorHandle,
};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Where this rank sits among the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Ranks a replica (T).
    pub size: usize,
    /// Which replica, and this rank's place in it (0: the lead).
    pub index: usize,
    pub rank: usize,
    /// Replicas in the world.
    pub count: usize,
}

impl Layout {
    /// From the target section's `tensor_parallel` (default 1) and the launcher's world; None
    /// when the target runs whole on each rank.
    pub fn of(target: &toml::Table, env: Option<&DistEnv>) -> Result<Option<Self>> {
        let size = match target.get("tensor_parallel") {
            None => 1,
            Some(v) => v
                .as_integer()
                .filter(|&t| t >= 1)
                .ok_or_else(|| anyhow!("[target] field `tensor_parallel`: {v} is not a number of ranks >= 1"))?
                as usize,
        };
        if size == 1 {
            return Ok(None);
        }
        let Some(env) = env else {
            bail!(
                "[target] field `tensor_parallel` = {size}: a replica of {size} ranks needs the run launched over a \
                 multiple of {size} ranks (`--nproc N` or torchrun)"
            );
        };
        if env.world % size != 0 {
            bail!(
                "[target] field `tensor_parallel` = {size}: WORLD_SIZE {} is not a multiple of {size} (replicas of \
                 {size} ranks)",
                env.world
            );
        }
        Ok(Some(Self { size, index: env.rank / size, rank: env.rank % size, count: env.world / size }))
    }

    pub fn is_lead(&self) -> bool {
        self.rank == 0
    }

    /// The global rank of replica `index`'s lead.
    pub fn lead_of(&self, index: usize) -> usize {
        index * self.size
    }

    fn prefix(&self) -> String {
        format!("dflash/replica/{}/", self.index)
    }

    /// What the target plugin is told: the run's store, the replica's keys, this rank's place.
    pub fn group(&self, env: &DistEnv) -> ReplicaGroup {
        ReplicaGroup {
            store: format!("{}:{}", env.master_addr, env.master_port).into(),
            prefix: self.prefix().into(),
            rank: self.rank as u32,
            size: self.size as u32,
            timeout_s: env.timeout.as_secs(),
        }
    }
}

/// One target call, as the lead posts it.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum Call {
    Forward {
        shape: Vec<i64>,
        ids: Vec<i64>,
        layers: Vec<u32>,
        logits: bool,
    },
    Generate {
        prompts: Vec<Vec<u32>>,
        max_new_tokens: u32,
        stop: Vec<u32>,
    },
    CacheReset,
    CacheExtend {
        shape: Vec<i64>,
        ids: Vec<i64>,
        layers: Vec<u32>,
    },
    CacheTruncate {
        len: u32,
    },
    /// The run is over.
    Stop,
}

fn ids_of(t: &Tensor) -> (Vec<i64>, Vec<i64>) {
    let flat = t.to_device(plugin_api::tch::Device::Cpu).to_kind(Kind::Int64).reshape([-1]);
    (t.size(), Vec::<i64>::try_from(flat).unwrap_or_default())
}

fn tensor_of(shape: &[i64], ids: &[i64]) -> Tensor {
    Tensor::from_slice(ids).view(shape)
}

/// The calls of one replica, numbered, in the store.
struct Calls {
    store: Store,
    prefix: String,
    next: u64,
}

impl Calls {
    fn key(&mut self) -> String {
        self.next += 1;
        format!("{}call/{}", self.prefix, self.next)
    }

    /// One of the replica's `followers` has read the call `key`: the last to read it removes it
    /// (and its count), so the store holds only the calls some rank has yet to read, however long
    /// the run. Counted in the store, not in a collective: a cache call runs none.
    fn read(&self, key: &str, followers: usize) -> Result<(), c10d::Error> {
        let readers = format!("{key}/read");
        if self.store.add(&readers, 1)? >= followers as i64 {
            self.store.delete(key)?;
            self.store.delete(&readers)?;
        }
        Ok(())
    }
}

/// Every rank other than a lead adds 1 here when it has read the end of the run.
const DONE_KEY: &str = "dflash/replica/done";

/// How long rank 0 (whose store serves the others) waits for every other rank to read the end.
const END_GRACE: Duration = Duration::from_secs(30);

/// The lead's target: each call is posted for the replica's other ranks, then run here. Dropped,
/// it posts the end of the run; on rank 0 it then waits until every rank that serves a target
/// has read it (the store goes with rank 0).
pub struct Lead {
    inner: TargetBox,
    calls: Calls,
    layout: Layout,
    /// A call failed (a rank of the replica may be gone): the end is posted, not waited for.
    failed: bool,
}

impl Lead {
    pub fn new(inner: TargetBox, layout: &Layout, store: Store) -> Self {
        Self { inner, calls: Calls { store, prefix: layout.prefix(), next: 0 }, layout: *layout, failed: false }
    }

    fn post(&mut self, call: &Call) -> Result<(), PluginError> {
        let key = self.calls.key();
        let bytes = serde_json::to_vec(call).expect("a call serializes");
        self.calls.store.set(&key, &bytes).map_err(|e| PluginError::new(format!("posting a target call: {e}")))
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        if self.post(&Call::Stop).is_err() || self.layout.index != 0 || self.failed {
            return;
        }
        let others = ((self.layout.size - 1) * self.layout.count) as i64;
        let started = Instant::now();
        while started.elapsed() < END_GRACE {
            match self.calls.store.add(DONE_KEY, 0) {
                Ok(n) if n < others => std::thread::sleep(POLL),
                _ => return,
            }
        }
        tracing::warn!("not every rank serving a target read the end of the run within {} s", END_GRACE.as_secs());
    }
}

/// `r`, a failure remembered in `failed`.
fn watch<T>(failed: &mut bool, r: RResult<T, PluginError>) -> RResult<T, PluginError> {
    *failed |= r.is_err();
    r
}

fn handle(t: &Tensor) -> TensorHandle {
    TensorHandle::new(t.shallow_clone())
}

impl TargetModel for Lead {
    fn spec(&self) -> RResult<TargetSpec, PluginError> {
        self.inner.spec()
    }

    fn tokenizer_json(&self) -> RResult<RString, PluginError> {
        self.inner.tokenizer_json()
    }

    fn embedding(&self) -> RResult<TensorHandle, PluginError> {
        self.inner.embedding()
    }

    fn lm_head(&self) -> RResult<TensorHandle, PluginError> {
        self.inner.lm_head()
    }

    fn forward(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
        want_logits: bool,
    ) -> RResult<TargetOutput, PluginError> {
        let (shape, ids) = ids_of(&input_ids.tensor());
        if let Err(e) = self.post(&Call::Forward { shape, ids, layers: layer_ids.to_vec(), logits: want_logits }) {
            return RErr(e);
        }
        watch(&mut self.failed, self.inner.forward(input_ids, layer_ids, want_logits))
    }

    fn generate(
        &mut self,
        prompts: RVec<RVec<u32>>,
        max_new_tokens: u32,
        stop_tokens: RSlice<'_, u32>,
    ) -> RResult<RVec<RVec<u32>>, PluginError> {
        let call = Call::Generate {
            prompts: prompts.iter().map(|p| p.to_vec()).collect(),
            max_new_tokens,
            stop: stop_tokens.to_vec(),
        };
        if let Err(e) = self.post(&call) {
            return RErr(e);
        }
        watch(&mut self.failed, self.inner.generate(prompts, max_new_tokens, stop_tokens))
    }

    fn cache_reset(&mut self) -> RResult<(), PluginError> {
        if let Err(e) = self.post(&Call::CacheReset) {
            return RErr(e);
        }
        watch(&mut self.failed, self.inner.cache_reset())
    }

    fn cache_extend(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
    ) -> RResult<TargetOutput, PluginError> {
        let (shape, ids) = ids_of(&input_ids.tensor());
        if let Err(e) = self.post(&Call::CacheExtend { shape, ids, layers: layer_ids.to_vec() }) {
            return RErr(e);
        }
        watch(&mut self.failed, self.inner.cache_extend(input_ids, layer_ids))
    }

    fn cache_truncate(&mut self, len: u32) -> RResult<(), PluginError> {
        if let Err(e) = self.post(&Call::CacheTruncate { len }) {
            return RErr(e);
        }
        watch(&mut self.failed, self.inner.cache_truncate(len))
    }
}

/// The lead's target as the pipeline holds it.
pub fn lead(inner: TargetHandle, layout: &Layout, store: Store) -> TargetHandle {
    let name = inner.name().to_string();
    let lead = Lead::new(inner.into_raw(), layout, store);
    TargetHandle::new(TargetModel_TO::from_value(lead, TD_Opaque), &name)
}

/// How often a waiting rank looks for the next call, and how long the lead's heartbeat may stand
/// still before it is named as gone.
const POLL: Duration = Duration::from_millis(20);
const LEAD_SILENT: Duration = Duration::from_secs(5);

/// A rank other than its replica's lead: run the lead's target calls until it says the run is
/// over. A lead that is gone (its heartbeat stopped, or its store) stops this rank with an error
/// naming it.
pub fn serve(target: &mut TargetHandle, layout: &Layout, store: Store, lead_beat: &str) -> Result<u64> {
    serve_then(target, layout, store, lead_beat, |_, _| Ok(()))
}

/// [`serve`], with `at_end` run on the store once the lead posted the end of the run (with the
/// number of calls served), before this rank says it has read it: what it writes there is in
/// the store before the lead's target is dropped.
///
/// A stop signal (crate::signals) does not stop this rank by itself: its lead stops the run (a
/// trainer after its step and checkpoint, which need this rank's part of the target) and posts
/// the end. Should the lead be gone after a signal instead (a command that a signal ends at
/// once), this rank ends with it, quietly; either way it exits with the signal's code.
pub fn serve_then(
    target: &mut TargetHandle,
    layout: &Layout,
    store: Store,
    lead_beat: &str,
    at_end: impl FnOnce(&Store, u64) -> Result<()>,
) -> Result<u64> {
    let stop = crate::signals::StopSignal::install()?;
    let mut served = 0u64;
    match (serve_calls(target, layout, store, lead_beat, at_end, &mut served), stop.requested()) {
        (Err(e), Some(code)) => {
            let sig = crate::signals::StopSignal::name(code);
            tracing::info!("{sig}, and target replica {} ended without its lead's word: {e:#}", layout.index);
            Ok(served)
        }
        (done, _) => done,
    }
}

fn serve_calls(
    target: &mut TargetHandle,
    layout: &Layout,
    store: Store,
    lead_beat: &str,
    at_end: impl FnOnce(&Store, u64) -> Result<()>,
    served: &mut u64,
) -> Result<u64> {
    let mut calls = Calls { store, prefix: layout.prefix(), next: 0 };
    let lead = layout.lead_of(layout.index);
    let gone = |why: String| anyhow!("rank {lead} gone (the lead of target replica {}): {why}", layout.index);
    loop {
        let key = calls.key();
        let (mut beat, mut since) = (calls.store.add(lead_beat, 0).map_err(|e| gone(e.to_string()))?, Instant::now());
        while !calls.store.check(&key).map_err(|e| gone(format!("its store does not answer: {e}")))? {
            std::thread::sleep(POLL);
            if since.elapsed() > LEAD_SILENT {
                let now = calls.store.add(lead_beat, 0).map_err(|e| gone(e.to_string()))?;
                if now == beat {
                    return Err(gone(format!("no heartbeat for {} s", LEAD_SILENT.as_secs())));
                }
                (beat, since) = (now, Instant::now());
            }
        }
        let bytes = calls.store.get(&key).map_err(|e| gone(e.to_string()))?;
        calls.read(&key, layout.size - 1).map_err(|e| gone(format!("its store does not answer: {e}")))?;
        let call: Call = serde_json::from_slice(&bytes).map_err(|e| anyhow!("target call {key}: {e}"))?;
        let failed = |e: anyhow::Error| anyhow!("target replica {}, rank {}: {e:#}", layout.index, layout.rank);
        match call {
            Call::Forward { shape, ids, layers, logits } => {
                target.forward(&handle(&tensor_of(&shape, &ids)), &layers, logits).map_err(failed)?;
            }
            Call::Generate { prompts, max_new_tokens, stop } => {
                target.generate(prompts, max_new_tokens, &stop).map_err(failed)?;
            }
            Call::CacheReset => target.cache_reset().map_err(failed)?,
            Call::CacheExtend { shape, ids, layers } => {
                target.cache_extend(&handle(&tensor_of(&shape, &ids)), &layers).map_err(failed)?;
            }
            Call::CacheTruncate { len } => target.cache_truncate(len).map_err(failed)?,
            Call::Stop => {
                at_end(&calls.store, *served)?;
                let _ = calls.store.add(DONE_KEY, 1);
                return Ok(*served);
            }
        }
        *served += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(rank: usize, world: usize) -> DistEnv {
        DistEnv {
            rank,
            world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            timeout: Duration::from_secs(30),
            run_token: None,
        }
    }

    #[test]
    fn ranks_form_replicas_of_consecutive_ranks() {
        let t = |s: &str| toml::from_str::<toml::Table>(s).unwrap();
        assert_eq!(Layout::of(&t("plugin = \"hf\""), None).unwrap(), None);
        let l = Layout::of(&t("tensor_parallel = 4"), Some(&env(6, 8))).unwrap().unwrap();
        assert_eq!(l, Layout { size: 4, index: 1, rank: 2, count: 2 });
        assert!(!l.is_lead() && l.lead_of(1) == 4);
        let g = l.group(&env(6, 8));
        assert_eq!(
            (g.store.as_str(), g.prefix.as_str(), g.rank, g.size),
            ("127.0.0.1:29500", "dflash/replica/1/", 2, 4)
        );
        let e = Layout::of(&t("tensor_parallel = 4"), Some(&env(0, 6))).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE 6 is not a multiple of 4"), "{e}");
        let e = Layout::of(&t("tensor_parallel = 2"), None).unwrap_err().to_string();
        assert!(e.starts_with("[target] field `tensor_parallel` = 2: a replica of 2 ranks needs"), "{e}");
        let call = Call::Forward { shape: vec![1, 2], ids: vec![5, 6], layers: vec![0, 3], logits: true };
        assert_eq!(serde_json::from_slice::<Call>(&serde_json::to_vec(&call).unwrap()).unwrap(), call);
    }

    /// A target whose forward meets the replica's other ranks (as a split target's collectives
    /// do) and whose cache calls meet nobody.
    struct Meeting(std::sync::Arc<std::sync::Barrier>);

    impl TargetModel for Meeting {
        fn spec(&self) -> RResult<TargetSpec, PluginError> {
            RErr(PluginError::new("not used"))
        }
        fn tokenizer_json(&self) -> RResult<RString, PluginError> {
            RErr(PluginError::new("not used"))
        }
        fn embedding(&self) -> RResult<TensorHandle, PluginError> {
            RErr(PluginError::new("not used"))
        }
        fn lm_head(&self) -> RResult<TensorHandle, PluginError> {
            RErr(PluginError::new("not used"))
        }
        fn forward(&mut self, ids: &TensorHandle, _: RSlice<'_, u32>, _: bool) -> RResult<TargetOutput, PluginError> {
            self.0.wait();
            plugin_api::abi_stable::std_types::ROk(TargetOutput {
                hidden: handle(&ids.tensor().to_kind(Kind::Float)),
                logits: plugin_api::abi_stable::std_types::RNone,
            })
        }
        fn generate(
            &mut self,
            p: RVec<RVec<u32>>,
            _: u32,
            _: RSlice<'_, u32>,
        ) -> RResult<RVec<RVec<u32>>, PluginError> {
            plugin_api::abi_stable::std_types::ROk(p)
        }
        fn cache_reset(&mut self) -> RResult<(), PluginError> {
            plugin_api::abi_stable::std_types::ROk(())
        }
        fn cache_extend(&mut self, ids: &TensorHandle, l: RSlice<'_, u32>) -> RResult<TargetOutput, PluginError> {
            self.forward(ids, l, false)
        }
        fn cache_truncate(&mut self, _: u32) -> RResult<(), PluginError> {
            plugin_api::abi_stable::std_types::ROk(())
        }
    }

    fn meeting(barrier: &std::sync::Arc<std::sync::Barrier>) -> TargetHandle {
        TargetHandle::new(TargetModel_TO::from_value(Meeting(barrier.clone()), TD_Opaque), "meeting")
    }

    /// Many calls through a replica of three ranks: each call leaves the store once both other
    /// ranks have read it, cache calls (which meet nobody) included, so rank 0's store does not
    /// grow with the run; at the end only the count of ranks that read the end is left.
    #[test]
    fn the_store_holds_no_call_every_rank_has_read() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let store = Store::serve(listener, Duration::from_secs(30)).unwrap();
        let layout = Layout { size: 3, index: 0, rank: 0, count: 1 };
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(3));
        let beat = "beat";
        store.add(beat, 1).unwrap();
        let before = store.num_keys().unwrap();
        let followers: Vec<_> = (1..3)
            .map(|rank| {
                let (store, barrier) = (store.another().unwrap(), barrier.clone());
                std::thread::spawn(move || {
                    let layout = Layout { rank, ..layout };
                    serve(&mut meeting(&barrier), &layout, store, beat).unwrap()
                })
            })
            .collect();
        let mut lead = Lead::new(meeting(&barrier).into_raw(), &layout, store.another().unwrap());
        let ids = TensorHandle::new(Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]));
        let calls = 300;
        for i in 0..calls {
            store.add(beat, 1).unwrap();
            lead.cache_truncate(i).unwrap();
            lead.cache_reset().unwrap();
            lead.forward(&ids, RSlice::from_slice(&[0]), false).unwrap();
            // Both other ranks met this forward, so they read every call up to it.
            assert_eq!(store.num_keys().unwrap(), before, "after {} calls", 3 * (i + 1));
        }
        drop(lead);
        for f in followers {
            assert_eq!(f.join().unwrap(), 3 * calls as u64);
        }
        assert_eq!(store.num_keys().unwrap(), before + 1);
        assert_eq!(store.add(DONE_KEY, 0).unwrap(), 2);
    }
}
