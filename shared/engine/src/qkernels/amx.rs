//! AMX-INT8 tiles for Q4_K and Q6_K matmuls of several rows (Intel Sapphire Rapids and later).
//!
//! One `tdpbssd` multiplies a tile of up to 16 input rows × 32 int8 values (`A`) by 32 values
//! of 16 weight columns (`B`, 8 rows of 4 values per column: exactly one Q4_K sub-block in the
//! column-interleaved lines of [`Q4K`]) into 16 × 16 i32 sums (`C`): 8,192 multiply-adds in one
//! instruction, where `vpdpbusd` does 64 (`sequoia engine-bench --kernels` measures both
//! peaks: on a Xeon, family 6 model 207, one core, 4.1 T multiply-adds/s on full tiles against
//! 0.49 T for 512-bit `vpdpbusd`).
//!
//! Per (column group, block) the kernel unpacks the block's nibbles once into int8 `q − 8`
//! (4 KiB, stays in L1) and every 16-row tile of the stripe multiplies against it. Each
//! sub-block's `C` is stored and scaled into the row's i32 sums by one `vpdpwssd` per row: a
//! sub-block's dot of `q − 8` is at most 32 · 8 · 127 = 32,512, so it fits the low i16 of
//! the lane (see [`super::scale_chains`]). The i32 sums are therefore the same integers the
//! `vpdpbusd` chains produce, and the block ends in the same [`q4k_finish`]: the results are
//! bit-identical to every other path.
//!
//! Q6_K works the same way on 16-value sub-blocks, unpacked as `q − 32`; its dots reach 65,024,
//! so the scale is a 32-bit multiply, and the tiles pay only from more rows
//! ([`TileFormat::MIN_ROWS`]).
//!
//! The tile registers: `tmm0`–`tmm3` the `C` of four sub-blocks in rotation, `tmm4`/`tmm5` and
//! `tmm6`/`tmm7` the `B` and `A` of two. Every `A` and `C` holds `min(m, 16)` rows, so one
//! configuration serves the whole call. Linux hands out tile state only on request
//! ([`available`] asks once per process); each call configures the tiles of its thread and
//! releases them when done.

use std::arch::asm;
use std::arch::x86_64::*;

// The AVX-512 steps around the tiles (scales, epilogues) move no bit fields: no GFNI needed.
type S = super::x86::Avx512<false>;
use super::{
    epi32, pf_dist, prefetch, q4k_finish, q6k_unpack, ActK, Format, OutPtr, Packed, Simd, G, Q4K,
    Q6K,
};

/// Rows of a full tile.
const TM: usize = 16;
/// Rows that pass over one unpacked block before the next group: their float sums (4 KiB)
/// and one block of their activations (33 KiB) stay in L1/L2.
const STRIPE: usize = 64;

/// `ldtilecfg`'s 64-byte operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Palette 1 with tiles `tmm0..` of `(rows, bytes per row)`.
    fn new(shapes: &[(usize, usize)]) -> TileConfig {
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, &(rows, bytes)) in shapes.iter().enumerate() {
            debug_assert!(rows <= 16 && bytes <= 64);
            cfg.rows[t] = rows as u8;
            cfg.colsb[t] = bytes as u16;
        }
        cfg
    }
}

#[repr(C, align(64))]
struct Aligned<T>(T);

/// Whether this CPU and OS run AMX-INT8 tiles (AMX-TILE and AMX-INT8 in CPUID, and Linux
/// granted this process the tile data state). Asked once.
pub(super) fn available() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU; leaf 7 is read only if listed.
        // (Safe functions since Rust 1.87; `unsafe` keeps the crate's rust-version building.)
        #[allow(unused_unsafe)]
        let edx = unsafe {
            if __cpuid(0).eax < 7 {
                return false;
            }
            __cpuid_count(7, 0).edx
        };
        let (tile, int8) = ((edx >> 24) & 1 == 1, (edx >> 25) & 1 == 1);
        tile && int8 && request_tile_state()
    })
}

/// Linux enables the 8 KiB of tile registers per process on request (`arch_prctl`), so that
/// processes that never use them do not pay for saving them.
#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request with no memory operands; failure (an older kernel, a VM without the
    // state) is an error code.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// A format with a tile kernel: how to unpack a (group, block) slot to int8, and how a
/// sub-block's stored products enter the rows' sums. The rest is [`tile`].
pub(super) trait TileFormat: Format<Act = ActK> {
    /// Values per sub-block (one scale): the `K` of one tile product.
    const SUB: usize;
    /// From this many input rows the tiles beat the `vpdpbusd` path.
    const MIN_ROWS: usize;
    /// Unpack the slot at `main` into int8 sub-blocks at `w` (`SUB · 16` bytes each, in the
    /// layout of `B`: 4 values of each of the 16 columns per 64-byte row), prefetching the
    /// slot at `pf` (0: none).
    ///
    /// # Safety
    /// `main` is a slot of this format, `w` 4 KiB.
    unsafe fn unpack(main: *const u8, w: *mut u8, pf: usize, end: usize);
    /// Add sub-block `sb`'s dots (row `r`'s 16 i32 at `c + 64 r`) times its scales to `sumi`.
    ///
    /// # Safety
    /// `main` is a slot of this format; `R` rows of products at `c`.
    unsafe fn add_scaled<const R: usize>(
        sumi: &mut [__m512i; R],
        main: *const u8,
        sb: usize,
        c: *const u8,
    );
    /// The block's float epilogue from its i32 sums, as on the `vpdpbusd` path.
    ///
    /// # Safety
    /// `main`/`aux` a slot of this format, `acts` live activation blocks.
    unsafe fn finish<const R: usize>(
        main: *const u8,
        aux: *const u8,
        acts: &[*const ActK; R],
        sumi: &[__m512i; R],
        out: &mut [__m512; R],
    );
}

/// Output columns of groups `groups` for `m` rows of `acts` on tiles if `m` reaches
/// [`TileFormat::MIN_ROWS`] (then `true`), else nothing (`false`).
///
/// # Safety
/// As [`columns`].
pub(super) unsafe fn try_columns<F: TileFormat>(
    p: &Packed<F>,
    acts: &[ActK],
    m: usize,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) -> bool {
    if m < F::MIN_ROWS {
        return false;
    }
    // SAFETY: the caller's contract.
    unsafe { columns(p, acts, m, groups, out) };
    true
}

impl TileFormat for Q4K {
    const SUB: usize = 32;
    /// At 8 rows the two paths ran even, at 10 the tiles 1.25× faster (`kernel_loop Q4K ROWS 1
    /// 3 amx|avx512vnni`, 8960 × 1536, one thread, Xeon family 6 model 207).
    const MIN_ROWS: usize = 9;

    /// A Q4_K (group, block) slot's 32 nibble lines as int8 `q − 8` in `w`: sub-block `s` at
    /// `512 · s`, its k-group `t` at `+ 64 · t` (the low nibbles of line `c` are k-group `c`, the
    /// high ones k-group `32 + c`). Prefetches the slot at `pf` (0: none) a line at a time.
    #[inline(always)]
    unsafe fn unpack(main: *const u8, w: *mut u8, pf: usize, end: usize) {
        // SAFETY: `main` is a slot of 32 lines, `w` 4 KiB (caller).
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            let e8 = _mm512_set1_epi8(8);
            // Four passes of 8 lines (one pair of sub-blocks), each prefetching 9 lines ahead:
            // one branch per pass, and a body the compiler unrolls.
            for j in 0..4 {
                if pf != 0 {
                    for l in 0..8 {
                        prefetch(pf + 512 * j + 64 * l, end);
                    }
                    // A line of the scales and mins, after the nibbles.
                    prefetch(pf + 2048 + 64 * j, end);
                }
                let (src, dst) = (main.add(512 * j), w.add(512 * j));
                for l in 0..8 {
                    let v = _mm512_loadu_si512(src.add(64 * l) as *const _);
                    let lo = _mm512_sub_epi8(_mm512_and_si512(v, m4), e8);
                    let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(v), m4), e8);
                    _mm512_store_si512(dst.add(64 * l) as *mut _, lo);
                    _mm512_store_si512(dst.add(2048 + 64 * l) as *mut _, hi);
                }
            }
        }
    }

    /// Through one `vpdpwssd` per row: the dot of `q − 8` fits the lane's low i16.
    #[inline(always)]
    unsafe fn add_scaled<const R: usize>(
        sumi: &mut [__m512i; R],
        main: *const u8,
        sb: usize,
        c: *const u8,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            let sc = S::load_u8_i32(main.add(2048 + 16 * sb));
            for (r, v) in sumi.iter_mut().enumerate() {
                *v = S::dpwssd(*v, S::load(c.add(64 * r)), sc);
            }
        }
    }

    #[inline(always)]
    unsafe fn finish<const R: usize>(
        main: *const u8,
        aux: *const u8,
        acts: &[*const ActK; R],
        sumi: &[__m512i; R],
        out: &mut [__m512; R],
    ) {
        // SAFETY: the caller's contract.
        unsafe { q4k_finish::<S, R>(main, aux, 0, acts, sumi, out, true) }
    }
}

impl TileFormat for Q6K {
    const SUB: usize = 16;
    /// Its scales take a 32-bit multiply per row and sub-block. In the 1.5B target's forward
    /// (2 threads, same Xeon; the threshold set by a temporary switch, not committed) tiles from
    /// 9 rows cost 5.7 ms of 78 at 16 rows and gained 1.5 ms of 132 at 32 and 7 of 247 at 64.
    const MIN_ROWS: usize = 32;

    /// A Q6_K (group, block) slot as int8 `q − 32` in `w`: sub-block `s` (16 values) at
    /// `256 · s`, its k-group `t` at `+ 64 · t`. The slot's bit planes hold k-group `16 q + l` in
    /// quarter `q` of line `l` ([`Q6K`]); prefetches the slot at `pf` (0: none).
    #[inline(always)]
    unsafe fn unpack(main: *const u8, w: *mut u8, pf: usize, end: usize) {
        // SAFETY: `main` is a Q6_K slot, `w` 4 KiB (caller).
        unsafe {
            let e32 = _mm512_set1_epi8(32);
            for l4 in 0..4 {
                if pf != 0 {
                    // 13 of the slot's 52 lines per pass.
                    for i in 0..13 {
                        prefetch(pf + 64 * (13 * l4 + i), end);
                    }
                }
                for l in 4 * l4..4 * l4 + 4 {
                    let hv = S::load(main.add(2048 + 64 * l));
                    let va = S::load(main.add(64 * l));
                    let vb = S::load(main.add(64 * (16 + l)));
                    for q in 0..4 {
                        let v = q6k_unpack::<S>(if q % 2 == 1 { vb } else { va }, hv, q);
                        _mm512_store_si512(
                            w.add(64 * (16 * q + l)) as *mut _,
                            _mm512_sub_epi8(v, e32),
                        );
                    }
                }
            }
        }
    }

    /// By a 32-bit multiply: a dot of `q − 32` over 16 values reaches 16 · 32 · 127 = 65,024,
    /// past i16.
    #[inline(always)]
    unsafe fn add_scaled<const R: usize>(
        sumi: &mut [__m512i; R],
        main: *const u8,
        sb: usize,
        c: *const u8,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            let sc = S::load_i8_i32(main.add(3072 + 16 * sb));
            for (r, v) in sumi.iter_mut().enumerate() {
                *v = _mm512_add_epi32(*v, _mm512_mullo_epi32(S::load(c.add(64 * r)), sc));
            }
        }
    }

    #[inline(always)]
    unsafe fn finish<const R: usize>(
        _main: *const u8,
        aux: *const u8,
        acts: &[*const ActK; R],
        sumi: &[__m512i; R],
        out: &mut [__m512; R],
    ) {
        // SAFETY: the caller's contract.
        unsafe { epi32::<S, _, R>(S::load_f16(aux), sumi, acts, out) }
    }
}

/// One block for a tile of `R` rows (`a`: the first row's activation block, the rest after it):
/// the block's sub-block products in tiles, scaled into i32 sums, then the format's epilogue into
/// the float sums at `o`. The tiles hold `tile_rows = min(m, 16)` rows; a tile of fewer rows than
/// that is the last one of a longer input and starts `tile_rows − R` rows early, its first rows
/// computed twice and dropped.
///
/// # Safety
/// The unpacked block at `w`, 16 KiB at `c`, `tile_rows` live activation blocks ending at
/// `a + R`, `R` rows of float sums at `o`, tiles configured for `F` ([`columns`]).
#[inline(always)]
unsafe fn tile<F: TileFormat, const R: usize>(
    main: *const u8,
    aux: *const u8,
    w: *const u8,
    c: *mut u8,
    a: *const ActK,
    o: *mut [f32; G],
    tile_rows: usize,
) {
    // SAFETY: the caller's contract; `products` covers 8 sub-blocks per call.
    unsafe {
        let stride = std::mem::size_of::<ActK>();
        let skip = tile_rows - R;
        let x = a.sub(skip) as *const u8;
        let subs = super::QK_K / F::SUB;
        for h in 0..subs / 8 {
            let s0 = 8 * h;
            match F::SUB {
                32 => products::<32>(x.add(32 * s0), stride, w.add(512 * s0), c.add(1024 * s0)),
                _ => products::<16>(x.add(16 * s0), stride, w.add(256 * s0), c.add(1024 * s0)),
            }
        }
        let mut sumi = [S::zero(); R];
        for sb in 0..subs {
            F::add_scaled(&mut sumi, main, sb, c.add(1024 * sb + 64 * skip));
        }
        let acts: [*const ActK; R] = std::array::from_fn(|r| a.add(r));
        let mut f: [__m512; R] = std::array::from_fn(|r| S::fload((*o.add(r)).as_ptr()));
        F::finish(main, aux, &acts, &sumi, &mut f);
        for (r, v) in f.iter().enumerate() {
            S::store((*o.add(r)).as_mut_ptr(), *v);
        }
    }
}

/// Output columns of groups `groups` for the `m` rows of `acts` (see [`Packed::columns`]).
///
/// # Safety
/// [`available`] and AVX-512 VNNI; `out` wraps a live `m × n` output whose columns of these
/// groups no other thread writes meanwhile; `m >= 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn columns<F: TileFormat>(
    p: &Packed<F>,
    acts: &[ActK],
    m: usize,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    assert_eq!(acts.len(), m * p.kb);
    // Every `A` and `C` holds `min(m, 16)` rows (see [`tile`]).
    let tm = m.min(TM);
    let (c_tile, b_tile, a_tile) = ((tm, 64), (F::SUB / 4, 64), (tm, F::SUB));
    let cfg = TileConfig::new(&[
        c_tile, c_tile, c_tile, c_tile, b_tile, b_tile, a_tile, a_tile,
    ]);
    // Scratch written before it is read, left uninitialized: zeroing 24 KiB cost ~7 % of a
    // call of 4 groups.
    let mut w = std::mem::MaybeUninit::<Aligned<[u8; 4096]>>::uninit();
    let mut c = std::mem::MaybeUninit::<Aligned<[u8; 16384]>>::uninit();
    let mut acc = std::mem::MaybeUninit::<Aligned<[[f32; G]; STRIPE]>>::uninit();
    let (wp, cp) = (w.as_mut_ptr() as *mut u8, c.as_mut_ptr() as *mut u8);
    let accp = acc.as_mut_ptr() as *mut [f32; G];
    // SAFETY: AMX available (caller); the configuration is a valid palette-1 layout.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
    let base = p.bytes().as_ptr();
    let end = base as usize + p.size_bytes();
    let dist = pf_dist::<F>(m);
    for r0 in (0..m).step_by(STRIPE) {
        let r1 = (r0 + STRIPE).min(m);
        for gi in groups.clone() {
            // SAFETY: group `gi` exists (caller): its slots lie inside the weights; rows
            // `r0..r1` of every block exist in `acts`; the buffers are local.
            unsafe {
                let g = base.add(gi * p.gstride);
                let aux = g.add(p.kb * F::MAIN);
                std::slice::from_raw_parts_mut(accp, r1 - r0).fill([0.0; G]);
                for b in 0..p.kb {
                    let main = g.add(b * F::MAIN);
                    // The first stripe streams the group from memory: prefetch ahead.
                    let pf = if r0 == 0 && dist > 0 {
                        main as usize + dist
                    } else {
                        0
                    };
                    F::unpack(main, wp, pf, end);
                    if pf != 0 {
                        prefetch(aux.add(b * F::AUX) as usize + dist, end);
                    }
                    let blk = acts.as_ptr().add(b * m);
                    let baux = aux.add(b * F::AUX);
                    for t0 in (r0..r1).step_by(TM) {
                        let rows = (r1 - t0).min(TM);
                        debug_assert!(rows <= tm && t0 + rows >= tm);
                        let a = blk.add(t0);
                        let o = accp.add(t0 - r0);
                        macro_rules! go {
                            ($($n:literal)*) => {
                                match rows {
                                    $($n => tile::<F, $n>(main, baux, wp, cp, a, o, tm),)*
                                    _ => unreachable!(),
                                }
                            };
                        }
                        go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
                    }
                }
                let c0 = gi * G;
                let valid = G.min(p.n - c0);
                for r in r0..r1 {
                    std::ptr::copy_nonoverlapping(
                        (*accp.add(r - r0)).as_ptr(),
                        out.at(r, c0, valid),
                        valid,
                    );
                }
            }
        }
    }
    // SAFETY: releases this thread's tile state.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The tile products of 8 sub-blocks of `SUB` values: sub-block `s`'s `A` from the activations
/// at `x + SUB · s` (rows `stride` apart), its `B` from the unpacked block at `w + 16 · SUB · s`,
/// its `C` stored at `c + 1024 · s`. Four `C` and two `A`/`B` registers in rotation, each `C`
/// stored two sub-blocks after its product starts, so the tile unit never waits on the store of
/// the product it just made.
///
/// # Safety
/// Tiles configured for `SUB` ([`columns`]); the rows of `A`, the 8 sub-blocks at `w` and
/// 8 KiB at `c` lie in live memory.
#[inline(always)]
unsafe fn products<const SUB: usize>(x: *const u8, stride: usize, w: *const u8, c: *mut u8) {
    macro_rules! sub {
        ($s:literal, $ct:literal, $at:literal, $bt:literal) => {
            concat!(
                "tilezero tmm",
                $ct,
                "\n",
                "tileloadd tmm",
                $at,
                ", [{x} + {xs} * 1 + {xd} * ",
                $s,
                "]\n",
                "tileloadd tmm",
                $bt,
                ", [{w} + {s64} * 1 + {wd} * ",
                $s,
                "]\n",
                "tdpbssd tmm",
                $ct,
                ", tmm",
                $at,
                ", tmm",
                $bt,
                "\n",
            )
        };
    }
    macro_rules! store {
        ($s:literal, $ct:literal) => {
            concat!(
                "tilestored [{c} + {s64} * 1 + 1024 * ",
                $s,
                "], tmm",
                $ct,
                "\n"
            )
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            sub!(0, 0, 6, 4),
            sub!(1, 1, 7, 5),
            sub!(2, 2, 6, 4),
            store!(0, 0),
            sub!(3, 3, 7, 5),
            store!(1, 1),
            sub!(4, 0, 6, 4),
            store!(2, 2),
            sub!(5, 1, 7, 5),
            store!(3, 3),
            sub!(6, 2, 6, 4),
            store!(4, 0),
            sub!(7, 3, 7, 5),
            store!(5, 1),
            store!(6, 2),
            store!(7, 3),
            x = in(reg) x,
            xs = in(reg) stride,
            w = in(reg) w,
            c = in(reg) c,
            s64 = in(reg) 64usize,
            xd = const SUB,
            wd = const 16 * SUB,
            options(nostack),
        );
    }
}

/// Multiply-adds per second of `tdpbssd` on full tiles (16 rows × 64 bytes against 64 × 16),
/// four independent chains, `iters` rounds: the tile unit's peak for `engine-bench --kernels`.
///
/// # Safety
/// [`available`].
pub(crate) unsafe fn peak_gmacs(iters: u64) -> f64 {
    let cfg = TileConfig::new(&[(16, 64); 6]);
    let t = std::time::Instant::now();
    // SAFETY: AMX available (caller); only tile registers are written, and released.
    unsafe {
        asm!(
            "ldtilecfg [{cfg}]",
            "tilezero tmm4",
            "tilezero tmm5",
            "2:",
            "tdpbssd tmm0, tmm4, tmm5",
            "tdpbssd tmm1, tmm4, tmm5",
            "tdpbssd tmm2, tmm4, tmm5",
            "tdpbssd tmm3, tmm4, tmm5",
            "dec {n}",
            "jnz 2b",
            "tilerelease",
            cfg = in(reg) &cfg,
            n = inout(reg) iters => _,
            options(nostack),
        );
    }
    iters as f64 * 4.0 * 16384.0 / t.elapsed().as_secs_f64() / 1e9
}
