//! FP8 linear layers as FP8 block-scaled checkpoints are served on Hopper (DeepSeek's recipe:
//! `quant_method: fp8`, `weight_block_size: [128, 128]`): weights e4m3 with a float32
//! `weight_scale_inv` per 128x128 block, activations quantised at run time per token per group of
//! 128 input channels (scale = amax / 448), fp32 accumulation, bf16 out.
//!
//! - [`quantize_weight_block`]: a bf16/fp32 weight to (e4m3, `weight_scale_inv`) in the
//!   checkpoint's layout, with transformers' arithmetic (a bf16 checkpoint run in FP8, as SGLang's
//!   `--quantization fp8`); [`dequantize_weight_block`] the other way.
//! - [`fp8_quantize_act`]: one pass of our kernel (csrc/fp8_quant.cu) on a CUDA device, libtorch
//!   ops elsewhere; the scales come out in the layout the GEMM wants.
//! - [`Fp8Linear`] / [`fp8_linear`]: the weight laid out for libtorch's block-scaled
//!   `_scaled_mm` (cuBLASLt on sm_90), and the layer's forward. On the CPU (and wherever the GEMM
//!   is not run) the same numbers come from the dequantised operands in fp32.
//!
//! What libtorch 2.11's `_scaled_mm` takes for this recipe (found on an H100 and an H200, cuBLASLt 13.1;
//! `scripts/bench/fp8_scaled_mm.py` asks it again): the left operand's scales `[M, K/128]` with
//! the rows contiguous (stride `(1, M)`), the weight's `[N/128, K/128]` row-major, passed
//! transposed; no fast accumulation; a bf16 bias. When K/128 is not a multiple of 4 it accepts
//! the call and returns garbage (the scales' rows are not 16-byte aligned), so K is padded with
//! zeros to a multiple of 512 here; N to a multiple of 16 (libtorch's own rule) and the
//! activations' rows to a multiple of 4 (cuBLASLt refuses other row counts with
//! CUBLAS_STATUS_NOT_SUPPORTED: each group's scales 16-byte aligned).

use crate::nvrtc;
use cudarc::driver::PushKernelArg;
use std::sync::atomic::AtomicBool;
use tch::{Device, Kind, TchError, Tensor};

/// The block edge of the weights' scales and the group size of the activations'.
pub const BLOCK: i64 = 128;
/// The largest finite e4m3 value.
pub const E4M3_MAX: f64 = 448.0;
/// A group's amax floor: a group of zeros gets a tiny finite scale (SGLang's eps).
const AMAX_FLOOR: f64 = 1e-10;
/// K is padded to a multiple of this (see the module's note), N to N_ALIGN, the rows to M_ALIGN.
const K_ALIGN: i64 = 4 * BLOCK;
const N_ALIGN: i64 = 16;
const M_ALIGN: i64 = 4;

const SRC: &str = concat!(include_str!("../csrc/bf16x8.cuh"), include_str!("../csrc/fp8_quant.cu"));
const KERNEL: &str = "fp8_quantize_act";
const ARCH: &str = "compute_90";
const THREADS: u32 = 256;

#[derive(Debug, thiserror::Error)]
pub enum Fp8Error {
    #[error("{what} has shape {shape:?}: {why}")]
    Shape { what: &'static str, shape: Vec<i64>, why: String },
    #[error("{what} is {kind:?}: {why}")]
    Kind { what: &'static str, kind: Kind, why: &'static str },
    #[error("{what} is on {device:?}, the weight on {weight:?}")]
    Device { what: &'static str, device: Device, weight: Device },
    #[error("the FP8 activation quantiser kernel: {0}")]
    Kernel(String),
    #[error("libtorch: {0}")]
    Torch(#[from] TchError),
}

type Result<T> = std::result::Result<T, Fp8Error>;

fn ceil_div(x: i64, by: i64) -> i64 {
    (x + by - 1) / by
}

fn round_up(x: i64, to: i64) -> i64 {
    ceil_div(x, to) * to
}

/// The input width the GEMM runs at for `k` input features.
pub fn padded_in(k: i64) -> i64 {
    round_up(k, K_ALIGN)
}

fn shape_error(what: &'static str, t: &Tensor, why: impl Into<String>) -> Fp8Error {
    Fp8Error::Shape { what, shape: t.size(), why: why.into() }
}

fn check_float(what: &'static str, t: &Tensor) -> Result<()> {
    match t.kind() {
        Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double => Ok(()),
        kind => Err(Fp8Error::Kind { what, kind, why: "expected a floating-point tensor" }),
    }
}

/// Whether this build's FP8 GEMM runs on `device`: a CUDA device of compute capability 9.x
/// (libtorch 2.11 runs block-scaled `_scaled_mm` on sm_90 only). Elsewhere [`fp8_linear`] still
/// computes the same numbers from the dequantised operands, at bf16-or-slower speed.
pub fn gemm_supported(device: Device) -> bool {
    let Device::Cuda(ordinal) = device else { return false };
    // SAFETY: only probes whether the driver library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::CudaContext::new(ordinal).and_then(|c| c.compute_capability()).is_ok_and(|(major, _)| major == 9)
}

/// A weight [out, in] (any float kind) as an FP8 block-scaled checkpoint holds it: e4m3 [out, in]
/// and `weight_scale_inv` f32 [ceil(out/128), ceil(in/128)]. transformers' arithmetic
/// (`Fp8Quantize`): a block's scale is 448 / amax (1 for a block of zeros), its values
/// clamp(w * scale) rounded to e4m3, and the stored number the scale's reciprocal. Edge blocks
/// of a shape that is not a multiple of 128 take the amax of the part that exists.
pub fn quantize_weight_block(w: &Tensor) -> Result<(Tensor, Tensor)> {
    check_float("the weight", w)?;
    let &[n, k] = w.size().as_slice() else { return Err(shape_error("the weight", w, "expected [out, in]")) };
    let (nb, kb) = (ceil_div(n, BLOCK), ceil_div(k, BLOCK));
    let blocks = w
        .f_to_kind(Kind::Float)?
        .f_constant_pad_nd([0, kb * BLOCK - k, 0, nb * BLOCK - n])?
        .f_view([nb, BLOCK, kb, BLOCK])?;
    let amax = blocks.f_abs()?.f_amax([1, 3], false)?;
    let nonzero = amax.f_gt(0.0)?;
    // PyTorch's `448 / t` is `t.reciprocal() * 448`: the same here, for the same bits.
    let scale = amax.f_where_scalarother(&nonzero, 1.0)?.f_reciprocal()?.f_mul_scalar(E4M3_MAX)?;
    let scale = scale.f_where_scalarother(&nonzero, 1.0)?;
    let q = blocks
        .f_mul(&scale.f_view([nb, 1, kb, 1])?)?
        .f_clamp(-E4M3_MAX, E4M3_MAX)?
        .f_to_kind(Kind::Float8e4m3fn)?
        .f_view([nb * BLOCK, kb * BLOCK])?
        .f_narrow(0, 0, n)?
        .f_narrow(1, 0, k)?
        .f_contiguous()?;
    Ok((q, scale.f_reciprocal()?))
}

/// `w_fp8` [out, in] times its block's `scale_inv` [ceil(out/128), ceil(in/128)], as `kind`.
pub fn dequantize_weight_block(w_fp8: &Tensor, scale_inv: &Tensor, kind: Kind) -> Result<Tensor> {
    check_block_scaled(w_fp8, scale_inv)?;
    let (n, k) = (w_fp8.size()[0], w_fp8.size()[1]);
    let s = scale_inv.f_repeat_interleave_self_int(BLOCK, 0, None)?.f_repeat_interleave_self_int(BLOCK, 1, None)?;
    let s = s.f_narrow(0, 0, n)?.f_narrow(1, 0, k)?;
    Ok(w_fp8.f_to_kind(Kind::Float)?.f_mul(&s)?.f_to_kind(kind)?)
}

fn check_block_scaled(w_fp8: &Tensor, scale_inv: &Tensor) -> Result<()> {
    if w_fp8.kind() != Kind::Float8e4m3fn {
        return Err(Fp8Error::Kind { what: "the FP8 weight", kind: w_fp8.kind(), why: "expected Float8e4m3fn" });
    }
    if scale_inv.kind() != Kind::Float {
        return Err(Fp8Error::Kind { what: "weight_scale_inv", kind: scale_inv.kind(), why: "expected Float (f32)" });
    }
    let &[n, k] = w_fp8.size().as_slice() else {
        return Err(shape_error("the FP8 weight", w_fp8, "expected [out, in]"));
    };
    let want = [ceil_div(n, BLOCK), ceil_div(k, BLOCK)];
    if scale_inv.size() != want {
        return Err(shape_error(
            "weight_scale_inv",
            scale_inv,
            format!("the weight [{n}, {k}] in 128x128 blocks needs {want:?}"),
        ));
    }
    if scale_inv.device() != w_fp8.device() {
        return Err(Fp8Error::Device { what: "weight_scale_inv", device: scale_inv.device(), weight: w_fp8.device() });
    }
    Ok(())
}

/// x [M, K] (any float kind) quantised per row per group of 128 columns: (x_fp8 [M', K'] e4m3,
/// scales [M', K'/128] f32 with the rows contiguous, stride (1, M')), K' = [`padded_in`]`(K)` and
/// M' = M rounded up to a multiple of 4; the padding is zeros (of scale 1e-10 / 448). A group's
/// scale is s = max(amax, 1e-10) / 448 and its values x / s rounded to e4m3 (nearest even), as
/// SGLang and vLLM serve block-scaled checkpoints. One pass of our kernel for bf16 on a CUDA
/// device (the last dim dense, rows 16-byte aligned), [`fp8_quantize_act_torch`] elsewhere.
pub fn fp8_quantize_act(x: &Tensor) -> Result<(Tensor, Tensor)> {
    quantize_act(x, padded_in(x.size().get(1).copied().unwrap_or(0)))
}

static FAILED: AtomicBool = AtomicBool::new(false);

fn quantize_act(x: &Tensor, k_p: i64) -> Result<(Tensor, Tensor)> {
    check_float("the activations", x)?;
    let &[m, k] = x.size().as_slice() else { return Err(shape_error("the activations", x, "expected [tokens, in]")) };
    if k > k_p || k_p % K_ALIGN != 0 {
        return Err(shape_error("the activations", x, format!("more columns than the GEMM's {k_p}")));
    }
    let m_p = round_up(m, M_ALIGN);
    if kernel_applies(x) {
        if let Some(out) = nvrtc::try_kernel(&FAILED, "the FP8 activation quantiser", || launch(x, m_p, k_p)) {
            return Ok(out);
        }
    }
    fp8_quantize_act_torch(x, m_p, k_p)
}

fn kernel_applies(x: &Tensor) -> bool {
    let (size, stride) = (x.size(), x.stride());
    nvrtc::enabled()
        && x.device().is_cuda()
        && x.kind() == Kind::BFloat16
        && stride[1] == 1
        && size[1] % 8 == 0
        && stride[0] % 8 == 0
        && x.data_ptr() as usize % 16 == 0
        && size[0] < i32::MAX as i64
}

fn launch(x: &Tensor, m_p: i64, k_p: i64) -> std::result::Result<(Tensor, Tensor), String> {
    let Device::Cuda(ordinal) = x.device() else { return Err("not a CUDA tensor".into()) };
    let module = nvrtc::module_for(ARCH, ordinal, SRC, &[], &[KERNEL])?;
    let groups = k_p / BLOCK;
    let q = Tensor::f_empty([m_p, k_p], (Kind::Float8e4m3fn, x.device())).map_err(|e| e.to_string())?;
    let scales = Tensor::f_empty([groups, m_p], (Kind::Float, x.device())).map_err(|e| e.to_string())?;
    let (m, k) = (x.size()[0] as i32, x.size()[1] as i32);
    let (px, ldx, pq, ps) = (x.data_ptr() as u64, x.stride()[0], q.data_ptr() as u64, scales.data_ptr() as u64);
    let (m_p32, groups32) = (m_p as i32, groups as i32);
    let stream = module.stream();
    let mut launch = stream.launch_builder(module.function(KERNEL));
    launch.arg(&px).arg(&ldx).arg(&m).arg(&k).arg(&pq).arg(&ps).arg(&m_p32).arg(&groups32);
    // 16 threads a group: 16 groups a CTA of 256.
    let config = nvrtc::grid_stride((groups * m_p) as u64, (THREADS / 16) as u64, THREADS);
    // SAFETY: x is a bf16 [m, k] CUDA tensor on this device with a dense last dim, 16-byte aligned
    // rows and k % 8 == 0 (`kernel_applies`); q [m_p, k_p] and scales [groups, m_p] were just
    // allocated there, m_p >= m even and k_p >= k; the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{KERNEL}: {e}"))?;
    Ok((q, scales.tr()))
}

/// [`fp8_quantize_act`]'s numbers from libtorch ops, rows padded to `m_p` and columns to `k_p`:
/// what runs where the kernel does not, and the kernel's reference in the CUDA tests.
pub fn fp8_quantize_act_torch(x: &Tensor, m_p: i64, k_p: i64) -> Result<(Tensor, Tensor)> {
    let (m, k) = (x.size()[0], x.size()[1]);
    let groups = k_p / BLOCK;
    let g = x.f_to_kind(Kind::Float)?.f_constant_pad_nd([0, k_p - k, 0, m_p - m])?.f_view([m_p, groups, BLOCK])?;
    // Tensor by tensor: libtorch divides by a scalar as a multiply by its reciprocal, and the
    // kernel divides correctly rounded.
    let amax = g.f_abs()?.f_amax([2], false)?.f_clamp_min(AMAX_FLOOR)?;
    let scale = amax.f_div(&amax.f_full_like(E4M3_MAX)?)?;
    let q = g
        .f_div(&scale.f_unsqueeze(2)?)?
        .f_clamp(-E4M3_MAX, E4M3_MAX)?
        .f_to_kind(Kind::Float8e4m3fn)?
        .f_view([m_p, k_p])?;
    Ok((q, scale.f_tr()?.f_contiguous()?.f_tr()?))
}

/// x_fp8 [M', K'] times its groups' scales [M', K'/128], fp32.
pub fn dequantize_act(q: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let (m, k) = (q.size()[0], q.size()[1]);
    let g = q.f_to_kind(Kind::Float)?.f_view([m, k / BLOCK, BLOCK])?;
    Ok(g.f_mul(&scales.f_unsqueeze(2)?)?.f_view([m, k])?)
}

/// A linear layer's FP8 weight laid out for the block-scaled GEMM: the checkpoint's e4m3 [out, in]
/// and `weight_scale_inv`, zero-padded to [N', K'] and [ceil(out/128), K'/128] (N' a multiple of
/// 16, K' = [`padded_in`]`(in)`), and its bias as bf16 [N'].
pub struct Fp8Linear {
    pub weight: Tensor,
    pub scale_inv: Tensor,
    pub bias: Option<Tensor>,
    pub out_features: i64,
    pub in_features: i64,
}

impl Fp8Linear {
    /// From a block-scaled checkpoint's tensors (on the device the layer runs on).
    pub fn new(weight: &Tensor, scale_inv: &Tensor, bias: Option<&Tensor>) -> Result<Self> {
        check_block_scaled(weight, scale_inv)?;
        let (n, k) = (weight.size()[0], weight.size()[1]);
        let (n_p, k_p) = (round_up(n, N_ALIGN), padded_in(k));
        // Padded as bytes: the e4m3 zero is the byte 0, and fp8 tensors cannot be filled everywhere.
        let weight = if (n_p, k_p) == (n, k) {
            weight.f_contiguous()?
        } else {
            let bytes = weight.f_view_dtype(Kind::Uint8)?.f_constant_pad_nd([0, k_p - k, 0, n_p - n])?;
            bytes.f_view_dtype(Kind::Float8e4m3fn)?
        };
        let scale_inv = match k_p / BLOCK - scale_inv.size()[1] {
            0 => scale_inv.f_contiguous()?,
            more => scale_inv.f_constant_pad_nd([0, more])?,
        };
        let bias = match bias {
            None => None,
            Some(b) => {
                check_float("the bias", b)?;
                if b.size() != [n] {
                    return Err(shape_error("the bias", b, format!("expected [{n}]")));
                }
                if b.device() != weight.device() {
                    return Err(Fp8Error::Device { what: "the bias", device: b.device(), weight: weight.device() });
                }
                Some(b.f_to_kind(Kind::BFloat16)?.f_constant_pad_nd([0, n_p - n])?)
            }
        };
        Ok(Self { weight, scale_inv, bias, out_features: n, in_features: k })
    }

    /// A full-precision weight [out, in] quantised in 128x128 blocks ([`quantize_weight_block`]).
    pub fn quantize(weight: &Tensor, bias: Option<&Tensor>) -> Result<Self> {
        let (q, scale_inv) = quantize_weight_block(weight)?;
        Self::new(&q, &scale_inv, bias)
    }

    /// The weight the GEMM multiplies by, dequantised: [out, in] as `kind`.
    pub fn dequantized(&self, kind: Kind) -> Result<Tensor> {
        let w = dequantize_weight_block(&self.weight, &self.scale_inv, Kind::Float)?;
        Ok(w.f_narrow(0, 0, self.out_features)?.f_narrow(1, 0, self.in_features)?.f_to_kind(kind)?)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        fp8_linear(x, self)
    }
}

/// y = x W^T + b, bf16 [..., out], for x [..., in] (any float kind): x quantised per token per
/// 128 channels ([`fp8_quantize_act`]), then libtorch's block-scaled `_scaled_mm` with fp32
/// accumulation on CUDA. On the CPU the same product of the dequantised operands in fp32.
pub fn fp8_linear(x: &Tensor, w: &Fp8Linear) -> Result<Tensor> {
    check_float("the activations", x)?;
    let size = x.size();
    if size.last() != Some(&w.in_features) {
        return Err(shape_error("the activations", x, format!("the weight takes {} input features", w.in_features)));
    }
    if x.device() != w.weight.device() {
        return Err(Fp8Error::Device { what: "the activations", device: x.device(), weight: w.weight.device() });
    }
    let mut out_size = size.clone();
    *out_size.last_mut().expect("checked above") = w.out_features;
    let x2 = x.f_reshape([-1, w.in_features])?;
    let m = x2.size()[0];
    if m == 0 {
        return Ok(Tensor::f_zeros(out_size.as_slice(), (Kind::BFloat16, x.device()))?);
    }
    let (q, scales) = quantize_act(&x2, w.weight.size()[1])?;
    let y = if x.device().is_cuda() {
        q.f_internal_scaled_mm(
            &w.weight.f_tr()?,
            &scales,
            &w.scale_inv.f_tr()?,
            w.bias.as_ref(),
            None::<&Tensor>,
            Kind::BFloat16,
            false,
        )?
    } else {
        let wd = dequantize_weight_block(&w.weight, &w.scale_inv, Kind::Float)?;
        let y = dequantize_act(&q, &scales)?.f_matmul(&wd.f_tr()?)?;
        let y = match &w.bias {
            Some(b) => y.f_add(&b.f_to_kind(Kind::Float)?)?,
            None => y,
        };
        y.f_to_kind(Kind::BFloat16)?
    };
    let y = y.f_narrow(0, 0, m)?;
    let y = if y.size()[1] == w.out_features { y } else { y.f_narrow(1, 0, w.out_features)?.f_contiguous()? };
    Ok(y.f_reshape(out_size.as_slice())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The kernel compiles with NVRTC for compute_90 (no GPU needed), with the hardware's e4m3
    /// conversion and no local memory.
    #[test]
    fn the_kernel_compiles() {
        let ptx = nvrtc::compile_for(ARCH, SRC, &[]).unwrap();
        let text = ptx.to_src();
        assert!(text.contains(".entry fp8_quantize_act"));
        assert!(text.contains("cvt.rn.satfinite.e4m3x2.f32"), "the hardware conversion is used");
        assert!(!text.contains(".local"), "the kernel uses local memory");
    }

    /// tests/fixtures/fp8_block.safetensors (scripts/fixtures/make_fp8_block_fixture.py).
    fn fixture() -> HashMap<String, Tensor> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/fp8_block.safetensors");
        Tensor::read_safetensors(path).unwrap().into_iter().collect()
    }

    fn bytes(t: &Tensor) -> Tensor {
        t.view_dtype(Kind::Uint8)
    }

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[])
    }

    /// transformers' `Fp8Quantize` bit for bit: a block of zeros (scale_inv 1), a block whose
    /// outlier pushes the rest into e4m3's subnormals.
    #[test]
    fn the_weight_quantiser_is_transformers() {
        let f = fixture();
        let (q, scale_inv) = quantize_weight_block(&f["w"]).unwrap();
        assert_eq!(q.kind(), Kind::Float8e4m3fn);
        assert!(bytes(&q).equal(&f["w_q"]), "e4m3 bytes differ from transformers'");
        assert!(scale_inv.equal(&f["w_scale_inv"]), "{scale_inv} != {}", f["w_scale_inv"]);
        // And back: the dequantised weight within e4m3's rounding (2^-4 of each block's amax).
        let back = dequantize_weight_block(&q, &scale_inv, Kind::Float).unwrap();
        let w = f["w"].to_kind(Kind::Float);
        let amax = w.abs().max().double_value(&[]);
        assert!((&back - &w).abs().max().double_value(&[]) <= amax / 16.0);
    }

    /// The served arithmetic (the fixture's PyTorch), on the CPU path: padded to [8, 512], the
    /// scales with the rows contiguous, a row of zeros, an outlier, values of 1e-6.
    #[test]
    fn the_activation_quantiser_is_the_served_arithmetic() {
        let f = fixture();
        let (q, scales) = fp8_quantize_act(&f["x"]).unwrap();
        assert_eq!((q.size(), scales.size(), scales.stride()), (vec![8, 512], vec![8, 4], vec![1, 8]));
        assert!(bytes(&q).equal(&f["x_q"]), "e4m3 bytes differ");
        assert!(scales.equal(&f["x_scale"]), "{scales} != {}", f["x_scale"]);
    }

    /// The layer on the CPU is the fixture's product of the dequantised operands, rounded to
    /// bf16 (2^-8 of each output at most), and within FP8's error of the bf16 operands' product.
    #[test]
    fn fp8_linear_on_the_cpu_is_the_dequantised_product() {
        let f = fixture();
        let layer = Fp8Linear::quantize(&f["w"], None).unwrap();
        let y = layer.forward(&f["x"]).unwrap();
        assert_eq!((y.kind(), y.size()), (Kind::BFloat16, vec![6, 256]));
        let err = rel(&y, &f["y"]);
        assert!(err < 4e-3, "against the dequantised product: {err}");
        let exact = f["x"].to_kind(Kind::Double).matmul(&f["w"].to_kind(Kind::Double).tr());
        let err = rel(&y, &exact);
        assert!(err < 0.06, "against the bf16 operands' product: {err}");
    }

    /// Shapes off the GEMM's grid: K padded to 512, N to 16, rows to 4, a bias, a batch of
    /// sequences; the result the same as one row at a time, and the padding cut off.
    #[test]
    fn odd_shapes_are_padded_and_cut_back() {
        tch::manual_seed(0);
        let w = Tensor::randn([200, 136], (Kind::Float, Device::Cpu)) * 0.05;
        let b = Tensor::randn([200], (Kind::Float, Device::Cpu));
        let layer = Fp8Linear::quantize(&w, Some(&b)).unwrap();
        assert_eq!((layer.weight.size(), layer.scale_inv.size()), (vec![208, 512], vec![2, 4]));
        let x = Tensor::randn([3, 5, 136], (Kind::BFloat16, Device::Cpu));
        let y = layer.forward(&x).unwrap();
        assert_eq!(y.size(), [3, 5, 200]);
        let row = layer.forward(&x.get(1).get(3).unsqueeze(0)).unwrap();
        assert!(row.get(0).equal(&y.get(1).get(3)), "a row's result depends on the others");
        let want = x.to_kind(Kind::Double).matmul(&w.to_kind(Kind::Double).tr()) + b.to_kind(Kind::Double);
        let err = rel(&y, &want);
        assert!(err < 0.06, "{err}");
    }

    /// Wrong inputs come back as errors that say what is wrong, never as a panic.
    #[test]
    fn wrong_inputs_are_refused_by_name() {
        let (q, s) = quantize_weight_block(&Tensor::randn([256, 384], (Kind::Float, Device::Cpu))).unwrap();
        let msg = |e: Fp8Error| e.to_string();
        let e = Fp8Linear::new(&q, &s.narrow(1, 0, 2), None).err().map(msg).unwrap();
        assert!(e.contains("weight_scale_inv") && e.contains("[2, 3]"), "{e}");
        let e = Fp8Linear::new(&q.to_kind(Kind::BFloat16), &s, None).err().map(msg).unwrap();
        assert!(e.contains("FP8 weight") && e.contains("Float8e4m3fn"), "{e}");
        let e = Fp8Linear::new(&q, &s, Some(&Tensor::zeros([255], (Kind::Float, Device::Cpu)))).err().map(msg).unwrap();
        assert!(e.contains("bias") && e.contains("[256]"), "{e}");
        let layer = Fp8Linear::new(&q, &s, None).unwrap();
        let e = layer.forward(&Tensor::zeros([4, 383], (Kind::BFloat16, Device::Cpu))).err().map(msg).unwrap();
        assert!(e.contains("384 input features"), "{e}");
        let e = layer.forward(&Tensor::zeros([4, 384], (Kind::Int64, Device::Cpu))).err().map(msg).unwrap();
        assert!(e.contains("floating-point"), "{e}");
        assert_eq!(layer.forward(&Tensor::zeros([0, 384], (Kind::BFloat16, Device::Cpu))).unwrap().size(), [0, 256]);
    }
}

/// The kernel and the GEMM against their references on a GPU. Ignored by `make test`; `make
/// gpu-test` runs them.
#[cfg(test)]
mod cuda_tests {
    use super::*;

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[])
    }

    /// The kernel's bytes and scales equal the libtorch reference's on the same GPU, for rows
    /// of a wider tensor, K off the 128 grid, odd row counts, a group of zeros, outliers and tiny
    /// values.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn fp8_activation_quantiser_cuda_matches_libtorch() {
        let dev = crate::cuda_test_device();
        for (m, k, wide) in [(4096, 4096, 4096), (77, 5120, 5200), (33, 200, 200), (1, 17408, 17408)] {
            tch::manual_seed(m);
            let base = Tensor::randn([m, wide], (Kind::Float, dev)) * 3.0;
            let _ = base.narrow(0, 0, 1).narrow(1, 0, 128.min(k)).fill_(0.0);
            if m > 3 {
                let _ = base.narrow(0, 1, 1).narrow(1, 0, 1).fill_(1e4);
                let _ = base.narrow(0, 2, 1).g_mul_scalar_(1e-7);
            }
            let x = base.to_kind(Kind::BFloat16).narrow(1, 0, k);
            assert!(kernel_applies(&x), "[{m}, {k}] of [{m}, {wide}]: the kernel applies");
            let (q, s) = nvrtc::with_enabled(true, || fp8_quantize_act(&x)).unwrap();
            assert!(!FAILED.load(std::sync::atomic::Ordering::Relaxed), "the kernel failed");
            let (m_p, k_p) = (round_up(m, M_ALIGN), padded_in(k));
            let (q_ref, s_ref) = fp8_quantize_act_torch(&x, m_p, k_p).unwrap();
            assert_eq!((q.size(), s.size(), s.stride()), (q_ref.size(), s_ref.size(), vec![1, m_p]));
            assert!(s.equal(&s_ref), "[{m}, {k}]: scales differ from libtorch's");
            let diff = q.view_dtype(Kind::Uint8).ne_tensor(&q_ref.view_dtype(Kind::Uint8)).sum(Kind::Int64);
            assert_eq!(i64::try_from(diff).unwrap(), 0, "[{m}, {k}]: e4m3 bytes differ from libtorch's");
        }
    }

    /// fp8_linear on the GPU (libtorch's block-scaled `_scaled_mm`) against the fp32 product of
    /// the same dequantised operands: the GEMM's products are exact and its sums fp32, so what
    /// is left is the bf16 rounding of each output, at most 2^-8 of it (measured ~1.7e-3 RMS):
    /// bound 4e-3. Against the unquantised operands the error is FP8's (~3%: both operands'
    /// e4m3 rounding, 2^-4 of a group's amax at most): bound 6%. The CPU path gives the same
    /// numbers.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn fp8_linear_cuda_matches_the_dequantised_matmul() {
        let dev = crate::cuda_test_device();
        assert!(gemm_supported(dev), "block-scaled FP8 GEMMs run on compute capability 9.x");
        for (m, n, k, bias) in
            [(512, 4096, 4096, true), (77, 400, 1040, false), (130, 1000, 200, true), (3, 128, 640, false)]
        {
            tch::manual_seed(n);
            let w = Tensor::randn([n, k], (Kind::Float, dev)) * 0.02;
            let b = bias.then(|| Tensor::randn([n], (Kind::Float, dev)));
            let x = Tensor::randn([m, k], (Kind::BFloat16, dev));
            let layer = nvrtc::with_enabled(true, || Fp8Linear::quantize(&w, b.as_ref())).unwrap();
            // The weight quantiser gives the same bytes on the GPU as on the CPU.
            let (q_cpu, s_cpu) = quantize_weight_block(&w.to_device(Device::Cpu)).unwrap();
            let (q_gpu, s_gpu) = quantize_weight_block(&w).unwrap();
            assert!(q_gpu.view_dtype(Kind::Uint8).to_device(Device::Cpu).equal(&q_cpu.view_dtype(Kind::Uint8)));
            assert!(s_gpu.to_device(Device::Cpu).equal(&s_cpu));

            let y = nvrtc::with_enabled(true, || layer.forward(&x)).unwrap();
            assert_eq!((y.kind(), y.size()), (Kind::BFloat16, vec![m, n]));
            let (q, s) = fp8_quantize_act_torch(&x, round_up(m, M_ALIGN), padded_in(k)).unwrap();
            let xd = dequantize_act(&q, &s).unwrap().narrow(0, 0, m).narrow(1, 0, k).to_kind(Kind::Double);
            let mut want = xd.matmul(&layer.dequantized(Kind::Double).unwrap().tr());
            if let Some(b) = &b {
                want += b.to_kind(Kind::Double);
            }
            let err = rel(&y, &want);
            let mut exact = x.to_kind(Kind::Double).matmul(&w.to_kind(Kind::Double).tr());
            if let Some(b) = &b {
                exact += b.to_kind(Kind::Double);
            }
            let fp8_err = rel(&y, &exact);
            eprintln!(
                "M {m} N {n} K {k}: against the dequantised product {err:.2e}, against bf16 operands {fp8_err:.2e}"
            );
            assert!(err < 4e-3, "M {m} N {n} K {k}: {err}");
            assert!(fp8_err < 0.06, "M {m} N {n} K {k}: {fp8_err}");
            let cpu =
                Fp8Linear::quantize(&w.to_device(Device::Cpu), b.as_ref().map(|b| b.to_device(Device::Cpu)).as_ref())
                    .unwrap()
                    .forward(&x.to_device(Device::Cpu))
                    .unwrap();
            let err = rel(&y.to_device(Device::Cpu), &cpu);
            assert!(err < 6e-3, "M {m} N {n} K {k}: the CPU path differs by {err}");
        }
    }
}
