//! Target features kept in CPU memory across epochs, keyed by the data loader's sequence ids:
//! the target is frozen, so a sequence's features never change and later epochs skip the target.
//!
//! Which batches read the cache is decided by the producer, in data order ([`plan`]), never by
//! the race between workers: a sequence's features from the cache and from a fresh forward pass
//! agree only up to rounding (a GEMM's result depends on the batch's shape), so a decision taken
//! by whichever worker comes first would make runs with several workers differ in the last bits.
//! A batch planned as a hit waits for the earlier job that stores its sequences.
//!
//! [`plan`]: HiddenStateCache::plan

use plugin_api::tch::{Device, Tensor};
use std::{
    collections::HashMap,
    sync::{Arc, Condvar, Mutex},
};

enum Row {
    /// Job `owner` will store this sequence, in `bytes`.
    Pending { owner: u64, bytes: usize },
    Ready(Tensor),
}

#[derive(Default)]
struct State {
    bytes: usize,
    rows: HashMap<u64, Row>,
    /// Jobs planned as hits.
    hits: std::collections::HashSet<u64>,
}

pub struct HiddenStateCache {
    max_bytes: usize,
    bytes_per_token: usize,
    state: Mutex<State>,
    stored: Condvar,
}

/// A job's claim on the cache, held by its batch: dropping it (the job done, failed or thrown
/// away by a stopping pipeline) releases the rows it was to store, so nobody waits for them.
pub struct CacheTicket {
    cache: Arc<HiddenStateCache>,
    job: u64,
}

impl Drop for CacheTicket {
    fn drop(&mut self) {
        self.cache.release(self.job);
    }
}

impl HiddenStateCache {
    pub fn new(max_bytes: usize, bytes_per_token: usize) -> Arc<Self> {
        Arc::new(Self { max_bytes, bytes_per_token, state: Mutex::default(), stored: Condvar::new() })
    }

    /// Producer, in data order: job `job` reads the cache if every sequence is stored or claimed
    /// by an earlier job; otherwise it runs the target and claims the new sequences that fit.
    pub fn plan(self: &Arc<Self>, job: u64, ids: &[u64], lengths: &[u32]) -> CacheTicket {
        let mut s = self.state.lock().expect("cache lock");
        if self.max_bytes > 0 && ids.iter().all(|id| s.rows.contains_key(id)) {
            s.hits.insert(job);
        } else {
            for (&id, &len) in ids.iter().zip(lengths) {
                let size = len as usize * self.bytes_per_token;
                if s.rows.contains_key(&id) {
                    continue;
                }
                if s.bytes + size > self.max_bytes {
                    break;
                }
                s.bytes += size;
                s.rows.insert(id, Row::Pending { owner: job, bytes: size });
            }
        }
        CacheTicket { cache: Arc::clone(self), job }
    }

    /// The batch's features [B, S, F] on `device` if its job was planned as a hit (waiting for
    /// the jobs that store them). Positions past a sequence's length are zero: the drafter never
    /// sees them (context is strictly before an anchor, and anchors lie inside the sequence).
    /// None: run the target, then [`store`](Self::store).
    pub fn fetch(&self, ticket: &CacheTicket, ids: &[u64], seq_len: i64, device: Device) -> Option<Tensor> {
        let mut s = self.state.lock().expect("cache lock");
        if !s.hits.remove(&ticket.job) {
            return None;
        }
        loop {
            if ids.iter().any(|id| !s.rows.contains_key(id)) {
                return None; // a job that claimed a row failed or was dropped
            }
            if ids.iter().all(|id| matches!(s.rows[id], Row::Ready(_))) {
                break;
            }
            s = self.stored.wait(s).expect("cache lock");
        }
        let rows: Vec<Tensor> = ids
            .iter()
            .map(|id| match &s.rows[id] {
                Row::Ready(r) => r.constant_pad_nd([0, 0, 0, seq_len - r.size()[0]]),
                Row::Pending { .. } => unreachable!("checked ready"),
            })
            .collect();
        drop(s);
        Some(Tensor::stack(&rows, 0).to_device(device))
    }

    /// Keep the rows this job claimed: each sequence's features up to its length.
    pub fn store(&self, ticket: &CacheTicket, ids: &[u64], lengths: &[u32], hidden: &Tensor) {
        let mut s = self.state.lock().expect("cache lock");
        for (r, (&id, &len)) in ids.iter().zip(lengths).enumerate() {
            if matches!(s.rows.get(&id), Some(Row::Pending { owner, .. }) if *owner == ticket.job) {
                let row = hidden.get(r as i64).narrow(0, 0, len as i64).to_device(Device::Cpu).contiguous();
                s.rows.insert(id, Row::Ready(row));
            }
        }
        drop(s);
        self.stored.notify_all();
    }

    /// Forget the rows `job` claimed but did not store.
    fn release(&self, job: u64) {
        let mut s = self.state.lock().expect("cache lock");
        let unstored: Vec<(u64, usize)> = s
            .rows
            .iter()
            .filter_map(|(&id, r)| match r {
                Row::Pending { owner, bytes } if *owner == job => Some((id, *bytes)),
                _ => None,
            })
            .collect();
        for (id, bytes) in unstored {
            s.rows.remove(&id);
            s.bytes -= bytes;
        }
        s.hits.remove(&job);
        drop(s);
        self.stored.notify_all();
    }

    /// Bytes claimed (stored or to be stored).
    pub fn bytes(&self) -> usize {
        self.state.lock().expect("cache lock").bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Kind;
    use std::{sync::mpsc, thread, time::Duration};

    const ROW: usize = 3 * 4; // 3 f32 features per token

    #[test]
    fn cached_batches_equal_the_original_up_to_each_length() {
        let hidden = Tensor::randn([2, 5, 3], (Kind::Float, Device::Cpu));
        let cache = HiddenStateCache::new(1 << 20, ROW);
        let first = cache.plan(0, &[7, 9], &[5, 3]);
        assert!(cache.fetch(&first, &[7, 9], 5, Device::Cpu).is_none(), "first sight: run the target");
        cache.store(&first, &[7, 9], &[5, 3], &hidden);
        assert_eq!(cache.bytes(), 8 * ROW);
        // Another batch order and padding length.
        let again = cache.plan(1, &[9, 7], &[3, 5]);
        let got = cache.fetch(&again, &[9, 7], 6, Device::Cpu).unwrap();
        assert_eq!(got.size(), vec![2, 6, 3]);
        assert!(got.get(0).narrow(0, 0, 3).equal(&hidden.get(1).narrow(0, 0, 3)));
        assert!(got.get(1).narrow(0, 0, 5).equal(&hidden.get(0)));
        assert_eq!(got.get(0).narrow(0, 3, 3).abs().sum(Kind::Float).double_value(&[]), 0.0);
        // A batch with one unseen sequence runs the target and stores only the new one.
        let mixed = cache.plan(2, &[7, 4], &[5, 2]);
        assert!(cache.fetch(&mixed, &[7, 4], 5, Device::Cpu).is_none());
        assert_eq!(cache.bytes(), 10 * ROW);
    }

    #[test]
    fn the_byte_budget_is_respected() {
        let hidden = Tensor::randn([3, 4, 3], (Kind::Float, Device::Cpu));
        let cache = HiddenStateCache::new(8 * ROW, ROW); // two rows of 4 tokens
        let t = cache.plan(0, &[1, 2, 3], &[4, 4, 4]);
        cache.store(&t, &[1, 2, 3], &[4, 4, 4], &hidden);
        assert_eq!(cache.bytes(), 8 * ROW);
        let hit = cache.plan(1, &[1, 2], &[4, 4]);
        assert!(cache.fetch(&hit, &[1, 2], 4, Device::Cpu).is_some());
        let miss = cache.plan(2, &[3], &[4]);
        assert!(cache.fetch(&miss, &[3], 4, Device::Cpu).is_none());
    }

    /// Whatever order workers run in, a batch planned as a hit reads the rows an earlier job
    /// stores: it waits for them, and runs the target itself if that job is dropped.
    #[test]
    fn a_planned_hit_waits_for_the_earlier_job_or_its_release() {
        for store in [true, false] {
            let hidden = Tensor::randn([1, 4, 3], (Kind::Float, Device::Cpu));
            let cache = HiddenStateCache::new(1 << 20, ROW);
            let first = cache.plan(0, &[5], &[4]);
            let second = cache.plan(1, &[5], &[4]);
            let (tx, rx) = mpsc::channel();
            let c = Arc::clone(&cache);
            let waiter = thread::spawn(move || tx.send(c.fetch(&second, &[5], 4, Device::Cpu)).unwrap());
            assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "the later job ran ahead of the earlier one");
            if store {
                cache.store(&first, &[5], &[4], &hidden);
            }
            drop(first);
            let got = rx.recv_timeout(Duration::from_secs(10)).expect("the waiter was woken");
            waiter.join().unwrap();
            match got {
                Some(h) => assert!(store && h.equal(&hidden)),
                None => assert!(!store, "stored rows must be read"),
            }
        }
    }
}
