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
    /// Claimed by the job that will store it.
    Pending,
    Ready(Tensor),
}

#[derive(Default)]
struct State {
    bytes: usize,
    rows: HashMap<u64, Row>,
}

pub struct HiddenStateCache {
    max_bytes: usize,
    bytes_per_token: usize,
    state: Mutex<State>,
    stored: Condvar,
}

/// A job's plan, held by its batch: read the cache (`hit`), or run the target and store the rows
/// it `claimed`. Dropping it (the job done, failed or thrown away by a stopping pipeline)
/// releases the claimed rows it did not store, so nobody waits for them.
pub struct CacheTicket {
    cache: Arc<HiddenStateCache>,
    hit: bool,
    /// Sequence ids and their bytes.
    claimed: Vec<(u64, usize)>,
}

impl Drop for CacheTicket {
    fn drop(&mut self) {
        self.cache.release(&self.claimed);
    }
}

impl HiddenStateCache {
    pub fn new(max_bytes: usize, bytes_per_token: usize) -> Arc<Self> {
        Arc::new(Self { max_bytes, bytes_per_token, state: Mutex::default(), stored: Condvar::new() })
    }

    /// Producer, in data order: a batch reads the cache if every sequence is stored or claimed
    /// by an earlier job; otherwise it runs the target and claims the new sequences that fit.
    pub fn plan(self: &Arc<Self>, ids: &[u64], lengths: &[u32]) -> CacheTicket {
        let mut s = self.state.lock().expect("cache lock");
        let hit = self.max_bytes > 0 && ids.iter().all(|id| s.rows.contains_key(id));
        let mut claimed = Vec::new();
        if !hit {
            for (&id, &len) in ids.iter().zip(lengths) {
                let size = len as usize * self.bytes_per_token;
                if s.rows.contains_key(&id) {
                    continue;
                }
                if s.bytes + size > self.max_bytes {
                    break;
                }
                s.bytes += size;
                s.rows.insert(id, Row::Pending);
                claimed.push((id, size));
            }
        }
        CacheTicket { cache: Arc::clone(self), hit, claimed }
    }

    /// The batch's features [B, S, F] on `device` if its job was planned as a hit (waiting for
    /// the jobs that store them). Positions past a sequence's length are zero: the drafter never
    /// sees them (context is strictly before an anchor, and anchors lie inside the sequence).
    /// None: run the target, then [`store`](Self::store).
    pub fn fetch(&self, ticket: &CacheTicket, ids: &[u64], seq_len: i64, device: Device) -> Option<Tensor> {
        if !ticket.hit {
            return None;
        }
        let mut s = self.state.lock().expect("cache lock");
        let rows: Vec<Tensor> = loop {
            if ids.iter().any(|id| !s.rows.contains_key(id)) {
                return None; // a job that claimed a row failed or was dropped
            }
            let ready: Vec<Tensor> = ids
                .iter()
                .filter_map(|id| match &s.rows[id] {
                    Row::Ready(r) => Some(r.shallow_clone()),
                    Row::Pending => None,
                })
                .collect();
            if ready.len() == ids.len() {
                break ready;
            }
            s = self.stored.wait(s).expect("cache lock");
        };
        drop(s);
        let rows: Vec<Tensor> = rows.iter().map(|r| r.constant_pad_nd([0, 0, 0, seq_len - r.size()[0]])).collect();
        Some(Tensor::stack(&rows, 0).to_device(device))
    }

    /// Keep the rows this job claimed: each sequence's features up to its length.
    pub fn store(&self, ticket: &CacheTicket, ids: &[u64], lengths: &[u32], hidden: &Tensor) {
        // Copied out before taking the lock: other workers plan and fetch meanwhile.
        let rows: Vec<(u64, Tensor)> = ids
            .iter()
            .zip(lengths)
            .enumerate()
            .filter(|(_, (id, _))| ticket.claimed.iter().any(|(c, _)| c == *id))
            .map(|(r, (&id, &len))| {
                (id, hidden.get(r as i64).narrow(0, 0, len as i64).to_device(Device::Cpu).contiguous())
            })
            .collect();
        let mut s = self.state.lock().expect("cache lock");
        for (id, row) in rows {
            s.rows.insert(id, Row::Ready(row));
        }
        drop(s);
        self.stored.notify_all();
    }

    /// Forget the claimed rows that were not stored.
    fn release(&self, claimed: &[(u64, usize)]) {
        let mut s = self.state.lock().expect("cache lock");
        for &(id, bytes) in claimed {
            if matches!(s.rows.get(&id), Some(Row::Pending)) {
                s.rows.remove(&id);
                s.bytes -= bytes;
            }
        }
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
        let first = cache.plan(&[7, 9], &[5, 3]);
        assert!(cache.fetch(&first, &[7, 9], 5, Device::Cpu).is_none(), "first sight: run the target");
        cache.store(&first, &[7, 9], &[5, 3], &hidden);
        assert_eq!(cache.bytes(), 8 * ROW);
        // Another batch order and padding length.
        let again = cache.plan(&[9, 7], &[3, 5]);
        let got = cache.fetch(&again, &[9, 7], 6, Device::Cpu).unwrap();
        assert_eq!(got.size(), vec![2, 6, 3]);
        assert!(got.get(0).narrow(0, 0, 3).equal(&hidden.get(1).narrow(0, 0, 3)));
        assert!(got.get(1).narrow(0, 0, 5).equal(&hidden.get(0)));
        assert_eq!(got.get(0).narrow(0, 3, 3).abs().sum(Kind::Float).double_value(&[]), 0.0);
        // A batch with one unseen sequence runs the target and stores only the new one.
        let mixed = cache.plan(&[7, 4], &[5, 2]);
        assert!(cache.fetch(&mixed, &[7, 4], 5, Device::Cpu).is_none());
        assert_eq!(cache.bytes(), 10 * ROW);
    }

    #[test]
    fn the_byte_budget_is_respected() {
        let hidden = Tensor::randn([3, 4, 3], (Kind::Float, Device::Cpu));
        let cache = HiddenStateCache::new(8 * ROW, ROW); // two rows of 4 tokens
        let t = cache.plan(&[1, 2, 3], &[4, 4, 4]);
        cache.store(&t, &[1, 2, 3], &[4, 4, 4], &hidden);
        assert_eq!(cache.bytes(), 8 * ROW);
        let hit = cache.plan(&[1, 2], &[4, 4]);
        assert!(cache.fetch(&hit, &[1, 2], 4, Device::Cpu).is_some());
        let miss = cache.plan(&[3], &[4]);
        assert!(cache.fetch(&miss, &[3], 4, Device::Cpu).is_none());
    }

    /// Whatever order workers run in, a batch planned as a hit reads the rows an earlier job
    /// stores: it waits for them, and runs the target itself if that job is dropped.
    #[test]
    fn a_planned_hit_waits_for_the_earlier_job_or_its_release() {
        for store in [true, false] {
            let hidden = Tensor::randn([1, 4, 3], (Kind::Float, Device::Cpu));
            let cache = HiddenStateCache::new(1 << 20, ROW);
            let first = cache.plan(&[5], &[4]);
            let second = cache.plan(&[5], &[4]);
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
