//! The loss's cross-entropy rows on the CPU in three passes over each row of logits (fp32 or
//! bf16), the rows split over libtorch's intra-op threads: (max, its first index), the sum of
//! exponentials, then the softmax gradient written over the logits. libtorch's log-softmax, exp,
//! argmax, scatter and scale take seven passes over [c, V] and, for bf16 logits, two conversions
//! of the whole chunk to fp32 and back; at a 49K vocabulary those passes cost more than the LM
//! head's products on two cores with AMX. Each row is one thread's, summed in a fixed order, so
//! results do not depend on the thread count.

use crate::cross_entropy::Rows;
use tch::{Device, Kind, Tensor};

/// The statistics and (with `grad` = (kind, row scale [c])) the gradient of z [c, V] (CPU, fp32
/// or bf16, rows contiguous) against labels [c], as [`crate::cross_entropy::rows`] gives them on
/// CUDA; the gradient is written over z, so `kind` must be z's. Err(z) where that does not apply.
pub fn rows(z: Tensor, labels: &Tensor, grad: Option<(Kind, &Tensor)>) -> Result<Rows, Tensor> {
    let (c, v) = (z.size()[0], z.size()[1]);
    let applies = z.device() == Device::Cpu
        && matches!(z.kind(), Kind::Float | Kind::BFloat16)
        && z.stride()[1] == 1
        && c > 0
        && v > 0
        && grad.is_none_or(|(k, _)| k == z.kind());
    if !applies {
        return Err(z);
    }
    let labels = labels.to_kind(Kind::Int64).contiguous();
    let scale = grad.map(|(_, s)| s.to_kind(Kind::Float).contiguous());
    let label_of: Vec<i64> = Vec::try_from(&labels).expect("int64 labels");
    if label_of.iter().any(|&l| l < 0 || l >= v) {
        return Err(z); // libtorch's ops name the bad label
    }
    let scale_of: Option<Vec<f32>> = scale.map(|s| Vec::try_from(&s).expect("fp32 scales"));
    let (mut logp, mut hit) = (vec![0f32; c as usize], vec![false; c as usize]);
    let ld = z.stride()[0] as usize;
    let base = z.data_ptr() as usize;
    let elt = z.kind().elt_size_in_bytes();
    let bf16 = z.kind() == Kind::BFloat16;
    let threads = (tch::get_num_threads().max(1) as usize).min(c as usize);
    let per = (c as usize).div_ceil(threads);
    std::thread::scope(|s| {
        for (t, (logp, hit)) in logp.chunks_mut(per).zip(hit.chunks_mut(per)).enumerate() {
            let (label_of, scale_of) = (&label_of, &scale_of);
            s.spawn(move || {
                for (i, (logp, hit)) in logp.iter_mut().zip(hit.iter_mut()).enumerate() {
                    let r = t * per + i;
                    let ptr = (base + r * ld * elt) as *mut u8;
                    let label = label_of[r] as usize;
                    let scale = scale_of.as_ref().map(|s| s[r]);
                    // SAFETY: row r of z is v elements of its kind at `ptr` (rows contiguous,
                    // checked above); each row is this thread's alone, and z outlives the scope.
                    let stats = unsafe {
                        if bf16 {
                            row(std::slice::from_raw_parts_mut(ptr as *mut u16, v as usize), label, scale)
                        } else {
                            row(std::slice::from_raw_parts_mut(ptr as *mut f32, v as usize), label, scale)
                        }
                    };
                    (*logp, *hit) = stats;
                }
            });
        }
    });
    let logp_label = Tensor::from_slice(&logp);
    let hit = Tensor::from_slice(&hit);
    Ok(Rows { logp_label, hit, grad: grad.is_some().then_some(z) })
}

/// A logit as stored: fp32, or bf16 as its bits.
trait Logit: Copy + Send {
    fn get(self) -> f32;
    fn put(x: f32) -> Self;
}

impl Logit for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
    #[inline(always)]
    fn put(x: f32) -> Self {
        x
    }
}

impl Logit for u16 {
    #[inline(always)]
    fn get(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    /// Round to nearest even, as libtorch converts (the inputs here are finite).
    #[inline(always)]
    fn put(x: f32) -> Self {
        let b = x.to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
}

/// One row: (the label's log-probability, whether the first index of the max is the label); with
/// a scale, the row becomes (softmax - onehot) * scale.
fn row<T: Logit>(z: &mut [T], label: usize, scale: Option<f32>) -> (f32, bool) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { row_avx512(z, label, scale) };
    }
    row_portable(z, label, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn row_avx512<T: Logit>(z: &mut [T], label: usize, scale: Option<f32>) -> (f32, bool) {
    row_portable(z, label, scale)
}

/// Lanes of the vector sums: a fixed order of additions whatever the CPU.
const LANES: usize = 16;

#[inline(always)]
fn row_portable<T: Logit>(z: &mut [T], label: usize, scale: Option<f32>) -> (f32, bool) {
    // 1. The max and its first index: per lane, then over the lanes and the tail.
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    let mut lane_at = [0u32; LANES];
    let mut chunks = z.chunks_exact(LANES);
    for (c, chunk) in (&mut chunks).enumerate() {
        for l in 0..LANES {
            let x = chunk[l].get();
            let better = x > lane_max[l];
            lane_max[l] = if better { x } else { lane_max[l] };
            lane_at[l] = if better { c as u32 } else { lane_at[l] };
        }
    }
    let tail = z.len() - chunks.remainder().len();
    let mut max = f32::NEG_INFINITY;
    let mut first = usize::MAX;
    for l in 0..LANES {
        let i = lane_at[l] as usize * LANES + l;
        if lane_max[l] > max || (lane_max[l] == max && i < first) {
            (max, first) = (lane_max[l], i);
        }
    }
    for (i, x) in chunks.remainder().iter().enumerate() {
        if x.get() > max {
            (max, first) = (x.get(), tail + i);
        }
    }
    // 2. The sum of exp(x - max), in LANES partial sums.
    let mut acc = [0f32; LANES];
    let mut chunks = z.chunks_exact(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            acc[l] += exp(chunk[l].get() - max);
        }
    }
    for (a, x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += exp(x.get() - max);
    }
    let sum: f32 = acc.iter().sum();
    let lse = max + sum.ln();
    let logp_label = z[label].get() - lse;
    // 3. The gradient: exp(x - lse) * scale, the label's entry expm1(logp) * scale (p - 1 near 1
    //    would round away).
    if let Some(scale) = scale {
        for x in z.iter_mut() {
            *x = T::put(exp(x.get() - lse) * scale);
        }
        z[label] = T::put(logp_label.exp_m1() * scale);
    }
    (logp_label, first == label)
}

/// exp(x) for x <= 0 in fp32 to about one ulp, branch-free so that it vectorises: x = n ln2 + r
/// with |r| <= ln2/2, a degree-6 polynomial for exp(r), 2^n from the exponent bits; 0 below -87.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.max(-87.0);
    let shifted = x * LOG2E + ROUND; // n in its low mantissa bits
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    p * two_n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulps_of_the_standard_library() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (ours, want) = (exp(x), x.exp());
            assert!((ours - want).abs() <= 2.0 * f32::EPSILON * want, "exp({x}) = {ours}, want {want}");
            x += 0.0137;
        }
        assert_eq!(exp(-1000.0), exp(-87.0)); // clamped, not a wrapped exponent
        assert_eq!(exp(0.0), 1.0);
    }

    /// libtorch's ops on the same rows: log-softmax in fp32, argmax, and the gradient.
    fn reference(z: &Tensor, labels: &Tensor, scale: &Tensor) -> (Tensor, Tensor, Tensor) {
        let logp = z.log_softmax(-1, Kind::Float);
        let logp_label = logp.gather(1, &labels.unsqueeze(1), false).squeeze_dim(1);
        let hit = z.argmax(-1, false).eq_tensor(labels);
        let onehot = Tensor::zeros_like(&logp).scatter_value(1, &labels.unsqueeze(1), 1.0);
        let grad = (logp.exp() - onehot) * scale.unsqueeze(1);
        (logp_label, hit, grad)
    }

    #[test]
    fn rows_equal_libtorchs_ops_in_fp32_and_bf16() {
        tch::manual_seed(3);
        let (c, v) = (37, 1003); // neither a multiple of the lanes
        let z32 = Tensor::randn([c, v], (Kind::Float, Device::Cpu)) * 4.0;
        // Row 0's label is its max, tied with a later entry: the first index counts.
        let _ = z32.get(0).get(5).fill_(100.0);
        let _ = z32.get(0).get(900).fill_(100.0);
        let labels = Tensor::randint(v, [c], (Kind::Int64, Device::Cpu));
        let _ = labels.get(0).fill_(5);
        let _ = labels.get(1).fill_(z32.get(1).argmax(0, false).int64_value(&[]));
        let scale = Tensor::rand([c], (Kind::Float, Device::Cpu));
        for kind in [Kind::Float, Kind::BFloat16] {
            let z = z32.to_kind(kind);
            let (want_logp, want_hit, want_grad) = reference(&z, &labels, &scale);
            let out = rows(z.copy(), &labels, Some((kind, &scale))).unwrap_or_else(|_| panic!("applies"));
            let e = (&out.logp_label - &want_logp).abs().max().double_value(&[]);
            assert!(e < 1e-5, "{kind:?}: log-probability off by {e}");
            assert!(out.hit.equal(&want_hit), "{kind:?}: hits");
            assert!(out.hit.get(0).int64_value(&[]) == 1 && out.hit.get(1).int64_value(&[]) == 1);
            let grad = out.grad.expect("grad").to_kind(Kind::Float);
            let tol = if kind == Kind::Float { 1e-6 } else { 4e-3 };
            let e = (&grad - &want_grad).abs().max().double_value(&[]);
            assert!(e < tol, "{kind:?}: gradient off by {e}");
            // Without a gradient the logits are left as they were.
            let kept = z.copy();
            let plain = rows(kept.shallow_clone(), &labels, None).unwrap_or_else(|_| panic!("applies"));
            assert!(plain.grad.is_none() && kept.equal(&z) && plain.logp_label.equal(&out.logp_label));
        }
    }

    #[test]
    fn the_thread_count_does_not_change_a_bit() {
        tch::manual_seed(4);
        let z = Tensor::randn([64, 4099], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let labels = Tensor::randint(4099, [64], (Kind::Int64, Device::Cpu));
        let scale = Tensor::rand([64], (Kind::Float, Device::Cpu));
        let threads = tch::get_num_threads();
        let run = |n| {
            tch::set_num_threads(n);
            rows(z.copy(), &labels, Some((Kind::BFloat16, &scale))).unwrap_or_else(|_| panic!("applies"))
        };
        let (one, three) = (run(1), run(3));
        tch::set_num_threads(threads);
        assert!(one.logp_label.equal(&three.logp_label) && one.grad.unwrap().equal(&three.grad.unwrap()));
    }

    #[test]
    fn what_does_not_apply_is_handed_back() {
        let labels = Tensor::from_slice(&[0i64, 1]);
        let half = Tensor::zeros([2, 8], (Kind::Half, Device::Cpu));
        assert!(rows(half, &labels, None).is_err());
        let strided = Tensor::zeros([8, 2], (Kind::Float, Device::Cpu)).tr();
        assert!(rows(strided, &labels, None).is_err());
        let out_of_range = Tensor::from_slice(&[0i64, 8]);
        assert!(rows(Tensor::zeros([2, 8], (Kind::Float, Device::Cpu)), &out_of_range, None).is_err());
    }
}
