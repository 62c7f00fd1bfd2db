//! Tensor and expert parallelism: one replica of the target spread over the T ranks of a c10d
//! group (Gloo on the CPU, NCCL on GPUs), Megatron's split:
//! - attention: q/k/v column-parallel by heads (with fewer key/value heads than ranks, each rank
//!   holds the one its query heads read, replicated), o_proj row-parallel; per-head sinks
//!   (gpt-oss) go with their heads;
//! - latent attention (DeepSeek-V3, LongCat-Flash): the low-rank q_a / kv_a projections and their
//!   norms replicated, q_b (or q_proj) and kv_b column-parallel by heads, o_proj row-parallel;
//! - the gated MLP (and the shared experts): gate/up column-parallel, down row-parallel;
//! - Gated DeltaNet: the value heads (and the key heads they read, as attention's key/value
//!   heads) column-parallel through the input projections and the conv, out_proj row-parallel;
//! - LFM2's short convolution: its channels column-parallel through in_proj (B, C and x) and the
//!   conv, out_proj row-parallel;
//! - routed experts: over E expert-parallel groups of T / E ranks, each group holding E-th of the
//!   experts and each rank of a group its 1 / (T / E) of their width;
//! - embeddings, norms, routers and the LM head replicated.
//!
//! Each row-parallel output is a partial sum: one all-reduce over the group after each token
//! mixer and each MLP (LongCat-Flash's shortcut MoE too) makes every rank's hidden state the
//! whole model's. What a row-parallel layer adds once (its bias, gpt-oss's experts' down bias,
//! the zero-computation experts' input) the first of the ranks sharing it adds. Each rank reads only its
//! part of every weight from the checkpoint (`Weights::take_selected`).
//!
//! A failed collective is kept (the forward goes on without collectives, its result refused)
//! and reported by [`TpGroup::check`] naming the rank that is gone: every rank beats a counter in
//! the store, and the rank whose counter stopped is the one named.

use c10d::{Backend, ProcessGroup, ReduceOp, Store};
use plugin_api::tch::{Device, Tensor};
use std::{
    ops::Range,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

/// Which part of the model a rank holds: rank `rank` of `size` tensor-parallel ranks, the experts
/// split over `expert_parallel` groups of `size / expert_parallel` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    pub expert_parallel: usize,
}

impl Shard {
    pub const WHOLE: Shard = Shard { rank: 0, size: 1, expert_parallel: 1 };

    pub fn new(rank: usize, size: usize, expert_parallel: usize) -> Result<Self, String> {
        if size == 0 || rank >= size {
            return Err(format!("tensor-parallel rank {rank} of {size}: the rank must be below the size"));
        }
        if expert_parallel == 0 || size % expert_parallel != 0 {
            return Err(format!(
                "field `expert_parallel` = {expert_parallel}: must divide `tensor_parallel` = {size} (the experts are \
                 split over groups of the replica's ranks)"
            ));
        }
        Ok(Self { rank, size, expert_parallel })
    }

    pub fn is_whole(&self) -> bool {
        self.size == 1
    }

    fn part(n: i64, parts: usize, index: usize, what: &str, field: &str) -> Result<Range<i64>, String> {
        let p = parts as i64;
        if n % p != 0 {
            return Err(format!("field `{field}` = {parts}: {what} ({n}) is not a multiple of {parts}"));
        }
        let i = index as i64;
        Ok(i * n / p..(i + 1) * n / p)
    }

    /// This rank's 1 / T of `n` (rows of a column-parallel matrix, columns of a row-parallel one).
    pub fn split(&self, n: i64, what: &str) -> Result<Range<i64>, String> {
        Self::part(n, self.size, self.rank, what, "tensor_parallel")
    }

    /// This rank's key/value heads of `n`: its 1 / T, or with fewer heads than ranks the one head
    /// its query heads read (replicated on T / n ranks).
    pub fn kv_heads(&self, n: i64, what: &str) -> Result<Range<i64>, String> {
        let t = self.size as i64;
        if n >= t || n <= 0 || t % n != 0 {
            return self.split(n, what);
        }
        let head = self.rank as i64 * n / t;
        Ok(head..head + 1)
    }

    /// This rank's routed experts of `n`: its group's 1 / E.
    pub fn experts(&self, n: i64) -> Result<Range<i64>, String> {
        let per_group = self.size / self.expert_parallel;
        Self::part(n, self.expert_parallel, self.rank / per_group, "the number of routed experts", "expert_parallel")
    }

    /// This rank's part of a routed expert's width `n`: 1 / (T / E).
    pub fn expert_width(&self, n: i64) -> Result<Range<i64>, String> {
        let per_group = self.size / self.expert_parallel;
        Self::part(
            n,
            per_group,
            self.rank % per_group,
            "an expert's intermediate size",
            "tensor_parallel / expert_parallel",
        )
    }
}

/// Whether `cfg`'s model splits as `shard` says: its routed experts split where `expert_parallel`
/// asks for it, and its heads, widths and experts divide evenly (checked from the config alone,
/// before any weight is read; the loader checks the same as it reads). Every family splits its
/// heads and widths.
pub fn check(cfg: &crate::config::DecoderConfig, shard: Shard) -> Result<(), String> {
    use crate::{config::Mixer, families::Parallelism};
    let parallelism = crate::families::family(&cfg.model_type).map(|f| f.parallelism());
    let moe = cfg.moe();
    if shard.expert_parallel > 1 && (moe.is_none() || parallelism != Some(Parallelism::TensorExpert)) {
        return Err(format!(
            "field `expert_parallel` = {}: `{}` has no routed experts that split; expert parallelism supports {}",
            shard.expert_parallel,
            cfg.model_type,
            crate::families::supporting(Parallelism::TensorExpert).join(", ")
        ));
    }
    if shard.is_whole() {
        return Ok(());
    }
    let layers = 0..cfg.num_hidden_layers;
    let has = |mixer: Mixer| layers.clone().any(|i| cfg.mixer(i) == mixer);
    if has(Mixer::Attention) || has(Mixer::Mla) {
        shard.split(cfg.num_attention_heads as i64, "the attention heads")?;
    }
    if has(Mixer::Attention) {
        shard.kv_heads(cfg.num_kv_heads() as i64, "the key/value heads")?;
    }
    if has(Mixer::Linear) {
        let s = cfg.linear();
        shard.split(s.value_heads as i64, "the Gated DeltaNet value heads")?;
        shard.kv_heads(s.key_heads as i64, "the Gated DeltaNet key heads")?;
    }
    if has(Mixer::ShortConv) {
        shard.split(cfg.hidden_size as i64, "the short convolution's channels (the hidden size)")?;
    }
    // LongCat-Flash's layers hold dense MLPs and the MoE beside them.
    let longcat = cfg.arch() == crate::config::Arch::LongcatFlash;
    if let Some(width) = cfg.dense_width().filter(|_| longcat || layers.clone().any(|i| !cfg.is_sparse_layer(i))) {
        shard.split(width as i64, "the MLP's intermediate size")?;
    }
    if let Some(m) = moe.filter(|_| longcat || layers.clone().any(|i| cfg.is_sparse_layer(i))) {
        shard.experts(m.experts as i64)?;
        shard.expert_width(m.intermediate as i64)?;
        if let Some(crate::config::SharedExpert::Gated(w) | crate::config::SharedExpert::Plain(w)) = m.shared {
            shard.split(w as i64, "the shared expert's intermediate size")?;
        }
    }
    Ok(())
}

/// Rows `heads` of heads `width` rows each.
pub fn rows(heads: &Range<i64>, width: i64) -> Range<i64> {
    heads.start * width..heads.end * width
}

/// The part of `t` that `sel` keeps (per dimension, its ranges in order; empty: all), contiguous.
pub fn select(t: &Tensor, sel: &[Vec<Range<i64>>]) -> Tensor {
    let mut t = t.shallow_clone();
    for (d, ranges) in sel.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        let parts: Vec<Tensor> = ranges.iter().map(|r| t.narrow(d as i64, r.start, r.end - r.start)).collect();
        t = Tensor::cat(&parts, d as i64);
    }
    t.contiguous()
}

/// Where a replica's ranks meet: the run's c10d store and this replica's key prefix in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendezvous {
    /// `host:port` of the store.
    pub store: String,
    pub prefix: String,
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
}

/// How often each rank beats its counter, and how many beats it may miss before it is named.
const HEARTBEAT: Duration = Duration::from_secs(1);
const MISSED_BEATS: u32 = 3;

/// A replica's process group, as the decoder's layers use it.
pub struct TpGroup {
    group: Mutex<ProcessGroup>,
    store: Mutex<Store>,
    prefix: String,
    pub rank: usize,
    pub size: usize,
    /// The first collective that failed, diagnosed.
    failed: Mutex<Option<String>>,
    beating: Arc<AtomicBool>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
}

impl TpGroup {
    /// Connect to the store `r` names and make the group: Gloo for a CPU model, NCCL on a GPU.
    pub fn join(r: &Rendezvous, device: Device) -> Result<Self, String> {
        let (host, port) =
            r.store.rsplit_once(':').ok_or_else(|| format!("tensor-parallel store `{}`: not host:port", r.store))?;
        let port: u16 = port.parse().map_err(|_| format!("tensor-parallel store `{}`: not host:port", r.store))?;
        let store = Store::connect(host.trim_matches(['[', ']']), port, r.timeout)
            .map_err(|e| format!("tensor-parallel rank {}: the store at {}: {e}", r.rank, r.store))?;
        Self::new(store, &r.prefix, r.rank, r.size, device, r.timeout)
    }

    /// The group over `store` (its keys under `prefix`), rank `rank` of `size`.
    pub fn new(
        store: Store,
        prefix: &str,
        rank: usize,
        size: usize,
        device: Device,
        timeout: Duration,
    ) -> Result<Self, String> {
        let backend = if device == Device::Cpu { Backend::Gloo } else { Backend::Nccl };
        let group = ProcessGroup::new(backend, &store, &format!("{prefix}pg/"), rank, size, timeout)
            .map_err(|e| format!("tensor-parallel rank {rank}: making the {} group: {e}", backend.name()))?;
        let beats = store.another().map_err(|e| format!("tensor-parallel rank {rank}: a second store client: {e}"))?;
        let beating = Arc::new(AtomicBool::new(true));
        let (flag, key) = (Arc::clone(&beating), beat_key(prefix, rank));
        let heartbeat = std::thread::Builder::new()
            .name("tp-heartbeat".into())
            .spawn(move || {
                while flag.load(Ordering::Relaxed) {
                    if beats.add(&key, 1).is_err() {
                        return; // the store is gone; the next collective says so
                    }
                    let beat = Instant::now();
                    while flag.load(Ordering::Relaxed) && beat.elapsed() < HEARTBEAT {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
            .map_err(|e| format!("starting the heartbeat: {e}"))?;
        Ok(Self {
            group: Mutex::new(group),
            store: Mutex::new(store),
            prefix: prefix.to_string(),
            rank,
            size,
            failed: Mutex::new(None),
            beating,
            heartbeat: Some(heartbeat),
        })
    }

    /// Sum `t` (contiguous) over the ranks, in place. After a failure, nothing: the forward's
    /// result is refused by [`check`](Self::check).
    pub fn all_reduce(&self, t: &Tensor, what: &str) {
        let mut failed = self.failed.lock().expect("failure lock");
        if failed.is_some() {
            return;
        }
        if let Err(e) = self.group.lock().expect("group lock").all_reduce(t, ReduceOp::Sum) {
            *failed = Some(self.explain(what, e));
        }
    }

    /// The first failed collective since the last check, as an error naming the rank gone.
    pub fn check(&self) -> Result<(), String> {
        match self.failed.lock().expect("failure lock").take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn explain(&self, what: &str, e: c10d::Error) -> String {
        let me = self.rank;
        match self.gone_ranks() {
            Ok(gone) if !gone.is_empty() => {
                let who: Vec<String> = gone.iter().map(|r| r.to_string()).collect();
                let s = if gone.len() > 1 { "s" } else { "" };
                format!(
                    "tensor-parallel rank{s} {} gone (no heartbeat for {MISSED_BEATS} s): the all-reduce of {what} failed on tensor-parallel rank {me}: {e}",
                    who.join(", ")
                )
            }
            Ok(_) => format!("the all-reduce of {what} failed on tensor-parallel rank {me} with no rank gone: {e}"),
            Err(store) => format!(
                "the store the replica met at does not answer ({store}): the all-reduce of {what} failed on tensor-parallel rank {me}: {e}"
            ),
        }
    }

    /// The ranks whose heartbeat stopped (counters read, then again after a few beats).
    fn gone_ranks(&self) -> c10d::Result<Vec<usize>> {
        let store = self.store.lock().expect("store lock");
        let read =
            || (0..self.size).map(|r| store.add(&beat_key(&self.prefix, r), 0)).collect::<c10d::Result<Vec<_>>>();
        let before = read()?;
        std::thread::sleep(HEARTBEAT * MISSED_BEATS);
        let after = read()?;
        Ok((0..self.size).filter(|&r| r != self.rank && after[r] == before[r]).collect())
    }
}

impl Drop for TpGroup {
    fn drop(&mut self) {
        self.beating.store(false, Ordering::Relaxed);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
    }
}

fn beat_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}beat/{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_and_widths_split_as_megatron_does() {
        let s = |rank, size, ep| Shard::new(rank, size, ep).unwrap();
        assert_eq!(s(1, 4, 1).split(32, "x").unwrap(), 8..16);
        // Fewer key/value heads than ranks: ranks 0, 1 read head 0, ranks 2, 3 head 1.
        assert_eq!((0..4).map(|r| s(r, 4, 1).kv_heads(2, "kv").unwrap()).collect::<Vec<_>>(), [0..1, 0..1, 1..2, 1..2]);
        assert_eq!(s(3, 4, 1).kv_heads(8, "kv").unwrap(), 6..8);
        // Experts over 2 groups of 2 ranks, each rank half an expert's width.
        assert_eq!((0..4).map(|r| s(r, 4, 2).experts(8).unwrap()).collect::<Vec<_>>(), [0..4, 0..4, 4..8, 4..8]);
        assert_eq!((0..4).map(|r| s(r, 4, 2).expert_width(8).unwrap()).collect::<Vec<_>>(), [0..4, 4..8, 0..4, 4..8]);
        let e = s(0, 4, 1).split(6, "the MLP's intermediate size").unwrap_err();
        assert_eq!(e, "field `tensor_parallel` = 4: the MLP's intermediate size (6) is not a multiple of 4");
        assert!(s(0, 4, 1).kv_heads(3, "key/value heads").is_err());
        assert!(Shard::new(0, 4, 3).unwrap_err().contains("field `expert_parallel` = 3"));
        let t = Tensor::arange(24, (plugin_api::tch::Kind::Float, Device::Cpu)).reshape([4, 6]);
        let got = select(&t, &[vec![1..2, 3..4], vec![0..1, 5..6]]);
        assert_eq!(Vec::<f32>::try_from(got.reshape([-1])).unwrap(), [6.0, 11.0, 18.0, 23.0]);
    }
}
