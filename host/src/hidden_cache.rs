//! Target features kept in CPU memory across epochs, keyed by the data loader's sequence ids:
//! the target is frozen, so a sequence's features never change and later epochs skip the target.

use plugin_api::tch::{Device, Tensor};
use std::collections::HashMap;

pub struct HiddenStateCache {
    max_bytes: usize,
    bytes: usize,
    rows: HashMap<u64, Tensor>,
    pub hits: u64,
    pub misses: u64,
}

impl HiddenStateCache {
    pub fn new(max_bytes: usize) -> Self {
        Self { max_bytes, bytes: 0, rows: HashMap::new(), hits: 0, misses: 0 }
    }

    /// The batch's features [B, S, F] on `device` if every sequence is cached. Positions past a
    /// sequence's length are zero: the drafter never sees them (context is strictly before an
    /// anchor, and anchors lie inside the sequence).
    pub fn get(&mut self, ids: &[u64], seq_len: i64, device: Device) -> Option<Tensor> {
        if self.max_bytes == 0 || !ids.iter().all(|id| self.rows.contains_key(id)) {
            self.misses += 1;
            return None;
        }
        self.hits += 1;
        let rows: Vec<Tensor> = ids
            .iter()
            .map(|id| {
                let r = &self.rows[id];
                r.constant_pad_nd([0, 0, 0, seq_len - r.size()[0]])
            })
            .collect();
        Some(Tensor::stack(&rows, 0).to_device(device))
    }

    /// Keep each sequence's unpadded features while the byte budget lasts.
    pub fn put(&mut self, ids: &[u64], lengths: &[u32], hidden: &Tensor) {
        for (r, (&id, &len)) in ids.iter().zip(lengths).enumerate() {
            if self.rows.contains_key(&id) {
                continue;
            }
            let row = hidden.get(r as i64).narrow(0, 0, len as i64);
            let size = row.numel() * row.kind().elt_size_in_bytes();
            if self.bytes + size > self.max_bytes {
                return;
            }
            self.bytes += size;
            self.rows.insert(id, row.to_device(Device::Cpu).contiguous());
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Kind;

    #[test]
    fn cached_batches_equal_the_original_up_to_each_length() {
        let hidden = Tensor::randn([2, 5, 3], (Kind::Float, Device::Cpu));
        let mut cache = HiddenStateCache::new(1 << 20);
        assert!(cache.get(&[7, 9], 5, Device::Cpu).is_none());
        cache.put(&[7, 9], &[5, 3], &hidden);
        // Another batch order and padding length.
        let got = cache.get(&[9, 7], 6, Device::Cpu).unwrap();
        assert_eq!(got.size(), vec![2, 6, 3]);
        assert!(got.get(0).narrow(0, 0, 3).equal(&hidden.get(1).narrow(0, 0, 3)));
        assert!(got.get(1).narrow(0, 0, 5).equal(&hidden.get(0)));
        assert_eq!(got.get(0).narrow(0, 3, 3).abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert_eq!((cache.hits, cache.misses), (1, 1));
    }

    #[test]
    fn the_byte_budget_is_respected() {
        let hidden = Tensor::randn([3, 4, 2], (Kind::Float, Device::Cpu));
        let mut cache = HiddenStateCache::new(2 * 4 * 2 * 4); // two rows of 4 x 2 floats
        cache.put(&[1, 2, 3], &[4, 4, 4], &hidden);
        assert_eq!(cache.bytes(), 64);
        assert!(cache.get(&[1, 2], 4, Device::Cpu).is_some());
        assert!(cache.get(&[3], 4, Device::Cpu).is_none());
    }
}
