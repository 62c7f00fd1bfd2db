//! The context part's gradients summed over its runs in one CUDA kernel (csrc/range_sum.cu):
//! [`crate::block_attention`]'s backward on a GPU, in place of fp32 accumulators, an add per run
//! and a cast.

use crate::nvrtc;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/range_sum.cu");
const KERNEL: &str = "range_sum";
const THREADS: u32 = 256;
/// The kernel's MAX_RUNS.
pub const MAX_RUNS: usize = 32;

/// The kernel's `Runs`, field for field.
#[repr(C)]
#[derive(Default)]
struct Runs {
    ptr: [u64; MAX_RUNS],
    sb: [i64; MAX_RUNS],
    sh: [i64; MAX_RUNS],
    sl: [i64; MAX_RUNS],
    from: [i32; MAX_RUNS],
    len: [i32; MAX_RUNS],
    n: i32,
}

// SAFETY: plain integers in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Runs {}

/// Whether the kernel sums `runs` ([B, H, len, D] tensors, each with the output row it starts
/// at) into `out` [B, H, rows, D]: bf16 on CUDA with the kernels enabled, at most `MAX_RUNS`
/// runs of out's batch, heads and D, every run inside out's rows, rows 16-byte aligned.
pub fn applies(out: &Tensor, runs: &[(Tensor, i64)]) -> bool {
    let o = out.size();
    let aligned = |t: &Tensor| {
        let st = t.stride();
        t.kind() == Kind::BFloat16
            && st[3] == 1
            && st[..3].iter().all(|s| s % 8 == 0)
            && t.data_ptr() as usize % 16 == 0
    };
    nvrtc::enabled()
        && out.device().is_cuda()
        && o.len() == 4
        && o[3] % 8 == 0
        && o[3] / 8 <= THREADS as i64
        && runs.len() <= MAX_RUNS
        && aligned(out)
        && runs.iter().all(|(t, from)| {
            let s = t.size();
            s.len() == 4
                && s[0] == o[0]
                && s[1] == o[1]
                && s[3] == o[3]
                && *from >= 0
                && from + s[2] <= o[2]
                && aligned(t)
        })
}

/// out = the sum of the runs over the rows each covers (zeros where none does), in fp32,
/// rounded once.
pub fn sum_into(out: &Tensor, runs: &[(Tensor, i64)]) -> Result<(), String> {
    if !applies(out, runs) {
        return Err(format!("{} runs into {:?}: not dense bf16 slabs of the output's shape", runs.len(), out.size()));
    }
    let Device::Cuda(ordinal) = out.device() else { return Err("not a CUDA tensor".into()) };
    let (b, h, rows, d) = (out.size()[0], out.size()[1], out.size()[2], out.size()[3]);
    if rows == 0 || b == 0 || h == 0 {
        return Ok(());
    }
    let m = nvrtc::module(ordinal, SRC, &[("D", d)], &[KERNEL])?;
    let mut p = Runs { n: runs.len() as i32, ..Default::default() };
    for (i, (t, from)) in runs.iter().enumerate() {
        let st = t.stride();
        (p.ptr[i], p.sb[i], p.sh[i], p.sl[i]) = (t.data_ptr() as u64, st[0], st[1], st[2]);
        (p.from[i], p.len[i]) = (*from as i32, t.size()[2] as i32);
    }
    let st = out.stride();
    let (po, ob, oh, ol, rows32) = (out.data_ptr() as u64, st[0], st[1], st[2], rows as i32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(KERNEL));
    launch.arg(&p).arg(&po).arg(&ob).arg(&oh).arg(&ol).arg(&rows32);
    let rows_a_cta = THREADS as i64 / (d / 8);
    let grid = (((rows + rows_a_cta - 1) / rows_a_cta) as u32, h as u32, b as u32);
    let config = LaunchConfig { grid_dim: grid, block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: every run and the output are live bf16 tensors on this device, read and written
    // through their checked strides and shapes (`applies`); the launch is ordered on libtorch's
    // stream, and the run tensors outlive it there (their memory returns to libtorch's caching
    // allocator, which reuses it only for work queued after this launch).
    unsafe { launch.launch(config) }.map_err(|e| format!("{KERNEL}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The kernel compiles with NVRTC (no GPU needed), and the parameter block matches its size.
    #[test]
    fn the_kernel_compiles() {
        for d in [64, 128, 256] {
            let ptx = super::nvrtc::compile(super::SRC, &[("D", d)]).unwrap_or_else(|e| panic!("D {d}: {e}"));
            let text = ptx.to_src();
            assert!(text.contains(".entry range_sum"));
            // The run table is read at constant offsets: no copy of it in local memory.
            assert!(!text.contains(".local"), "D {d}: the kernel uses local memory");
        }
        assert_eq!(std::mem::size_of::<super::Runs>(), 32 * 8 * 4 + 32 * 4 * 2 + 8);
    }
}
