//! The machine's roofline inputs, measured on the spot: read bandwidth (one thread and all
//! threads) and the int8 multiply-add peak per core of each dot-product instruction the kernels
//! use (512-bit `vpdpbusd`, 256-bit `vpdpbusd` (AVX-VNNI), AVX2 `vpmaddubsw` + `vpmaddwd`,
//! AMX `tdpbssd`).
//!
//! Why measured, not looked up: the CPU model changes between machines (and under VMs), and a
//! kernel's efficiency only means something against what this machine can do right now.
//! `sequoia engine-bench --kernels` prints each kernel's G MAC/s and GB/s as a share of these.
//! The peak loops are inline assembly so the compiler cannot merge or hoist the independent
//! accumulator chains. The AMX loop lives with the tile kernels (`qkernels/amx.rs`), which own
//! the tile configuration.

use std::time::Instant;

/// Measured peaks of this machine.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Peaks {
    /// Streaming read bandwidth, one thread, GB/s.
    pub read_gbps_one_thread: f64,
    /// Streaming read bandwidth with `threads` threads, GB/s.
    pub read_gbps_all_threads: f64,
    pub threads: usize,
    /// G int8 multiply-adds per second on one core, per instruction family that this CPU has
    /// (`"avx512vnni"`, `"avxvnni"`, `"avx2"`, and `"amx"`: `tdpbssd` on full 16 × 64-byte
    /// tiles, more than the kernels' 32-value sub-blocks let them use).
    pub int8_gmacs_per_core: Vec<(String, f64)>,
}

impl Peaks {
    /// The measured int8 peak of an ISA path (by the names above), if this CPU has it.
    pub fn int8_peak(&self, isa: &str) -> Option<f64> {
        self.int8_gmacs_per_core
            .iter()
            .find(|(n, _)| n == isa)
            .map(|&(_, g)| g)
    }
}

/// Measure everything (about a second on a 2-core machine).
pub fn measure(threads: usize) -> Peaks {
    let threads = threads.max(1);
    let mut int8 = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni") {
            // SAFETY: the features were just checked.
            int8.push(("avx512vnni".to_string(), unsafe { x86::vnni512() }));
        }
        if crate::qkernels::Isa::Amx.available() {
            // SAFETY: AMX-INT8 and the tile state were just checked.
            int8.push(("amx".to_string(), unsafe {
                crate::qkernels::amx_peak_gmacs(2_500_000)
            }));
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni") {
            // SAFETY: as above.
            int8.push(("avxvnni".to_string(), unsafe { x86::vnni256() }));
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            int8.push(("avx2".to_string(), unsafe { x86::maddubs256() }));
        }
    }
    Peaks {
        read_gbps_one_thread: read_bandwidth(1, 512 << 20),
        read_gbps_all_threads: read_bandwidth(threads, 512 << 20),
        threads,
        int8_gmacs_per_core: int8,
    }
}

/// Best of five streaming reads of a `bytes` buffer split over `threads` threads, GB/s.
pub fn read_bandwidth(threads: usize, bytes: usize) -> f64 {
    let words = bytes / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let per = words / threads;
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sink: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(per.max(1))
                .take(threads)
                .map(|c| s.spawn(move || xor_reduce(c)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0, |a, b| a ^ b)
        });
        std::hint::black_box(sink);
        let read = (per * threads * 8) as f64;
        best = best.max(read / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// XOR of all words with eight independent chains (the compiler vectorizes it; XOR keeps the
/// arithmetic trivially cheaper than the loads).
fn xor_reduce(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(8);
    for w in &mut it {
        for i in 0..8 {
            acc[i] ^= w[i];
        }
    }
    acc.iter()
        .fold(it.remainder().iter().fold(0, |a, b| a ^ b), |a, b| a ^ b)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::time::Instant;

    const ITERS: u64 = 10_000_000;

    /// 12 independent `vpdpbusd zmm` chains: 64 multiply-adds each.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn vnni512() -> f64 {
        let t = Instant::now();
        asm!(
            "vpternlogd zmm30, zmm30, zmm30, 0xff",
            "vpabsb zmm31, zmm30",
            "2:",
            "vpdpbusd zmm0, zmm31, zmm30",
            "vpdpbusd zmm1, zmm31, zmm30",
            "vpdpbusd zmm2, zmm31, zmm30",
            "vpdpbusd zmm3, zmm31, zmm30",
            "vpdpbusd zmm4, zmm31, zmm30",
            "vpdpbusd zmm5, zmm31, zmm30",
            "vpdpbusd zmm6, zmm31, zmm30",
            "vpdpbusd zmm7, zmm31, zmm30",
            "vpdpbusd zmm8, zmm31, zmm30",
            "vpdpbusd zmm9, zmm31, zmm30",
            "vpdpbusd zmm10, zmm31, zmm30",
            "vpdpbusd zmm11, zmm31, zmm30",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) ITERS => _,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
            out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
            out("zmm10") _, out("zmm11") _, out("zmm30") _, out("zmm31") _,
            options(nostack),
        );
        ITERS as f64 * 12.0 * 64.0 / t.elapsed().as_secs_f64() / 1e9
    }

    /// 12 independent `{vex} vpdpbusd ymm` chains: 32 multiply-adds each.
    #[target_feature(enable = "avx2,avxvnni")]
    pub(super) unsafe fn vnni256() -> f64 {
        let t = Instant::now();
        asm!(
            "vpcmpeqb ymm14, ymm14, ymm14",
            "vpabsb ymm15, ymm14",
            "2:",
            "{{vex}} vpdpbusd ymm0, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm1, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm2, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm3, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm4, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm5, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm6, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm7, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm8, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm9, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm10, ymm15, ymm14",
            "{{vex}} vpdpbusd ymm11, ymm15, ymm14",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) ITERS => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
            out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
            out("ymm10") _, out("ymm11") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
        ITERS as f64 * 12.0 * 32.0 / t.elapsed().as_secs_f64() / 1e9
    }

    /// Six chains of `vpmaddubsw` (u8·s8 → s16 pairs) + `vpmaddwd` (→ s32) + `vpaddd`: what an
    /// AVX2 int8 dot product costs per 32 multiply-adds.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn maddubs256() -> f64 {
        let t = Instant::now();
        asm!(
            "vpcmpeqb ymm14, ymm14, ymm14",
            "vpabsb ymm15, ymm14",
            "vpabsw ymm13, ymm14",
            "2:",
            "vpmaddubsw ymm0, ymm15, ymm14",
            "vpmaddubsw ymm1, ymm15, ymm14",
            "vpmaddubsw ymm2, ymm15, ymm14",
            "vpmaddubsw ymm3, ymm15, ymm14",
            "vpmaddubsw ymm4, ymm15, ymm14",
            "vpmaddubsw ymm5, ymm15, ymm14",
            "vpmaddwd ymm0, ymm0, ymm13",
            "vpmaddwd ymm1, ymm1, ymm13",
            "vpmaddwd ymm2, ymm2, ymm13",
            "vpmaddwd ymm3, ymm3, ymm13",
            "vpmaddwd ymm4, ymm4, ymm13",
            "vpmaddwd ymm5, ymm5, ymm13",
            "vpaddd ymm6, ymm6, ymm0",
            "vpaddd ymm7, ymm7, ymm1",
            "vpaddd ymm8, ymm8, ymm2",
            "vpaddd ymm9, ymm9, ymm3",
            "vpaddd ymm10, ymm10, ymm4",
            "vpaddd ymm11, ymm11, ymm5",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) ITERS => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _,
            out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _,
            out("ymm10") _, out("ymm11") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
        ITERS as f64 * 6.0 * 32.0 / t.elapsed().as_secs_f64() / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_return_plausible_figures() {
        let bw = read_bandwidth(1, 16 << 20);
        assert!(bw.is_finite() && bw > 0.1, "read bandwidth {bw} GB/s");
        let p = measure(1);
        for (isa, g) in &p.int8_gmacs_per_core {
            assert!(g.is_finite() && *g > 1.0, "{isa}: {g} G MAC/s");
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            assert!(p.int8_peak("avx2").is_some());
        }
    }
}
