//! One repacked kernel in a loop, for profiling it alone (`perf record` sees nothing else):
//! `cargo run --release -p sequoia-engine --example kernel_loop -- FORMAT ROWS COPIES REPS [ISA]
//! [COLUMNS]`, e.g. `… -- Q4K 8 1 20 avx2`. Each rep times the COLUMNS × 1536 shape (default
//! 8960, the gate/up projection) on one ISA path (`SEQUOIA_KERNEL_ISA`'s names; default
//! `avx512vnni`), one thread, as `sequoia engine-bench --kernels` does: each line gives the call
//! with the activations' quantization and then the kernel alone (activations quantized once;
//! compare the latter with a plain C loop such as `scripts/q5_0-block-bench.c`). COPIES = 1 keeps the
//! weights in cache (L3 at 8960 columns; 512 columns fit L2, the kernel's arithmetic alone);
//! 64 streams them from DRAM. `SEQUOIA_KERNEL_PF` and `SEQUOIA_KERNEL_PF_NEAR` set the
//! prefetch distances.

use sequoia_engine::kernels;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: usize| -> Result<usize, String> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse().map_err(|e| format!("argument {}: {e}", i + 1))
        })
    };
    let format = args.first().map_or("Q4K", String::as_str);
    let (rows, copies, reps) = (arg(1, 8)?, arg(2, 1)?, arg(3, 20)?);
    let isa_name = args.get(4).map_or("avx512vnni", String::as_str);
    let isa = kernels::Isa::from_name(isa_name).ok_or(format!("unknown ISA {isa_name}"))?;
    let columns = arg(5, 8960)?;
    if !isa.available() {
        return Err(format!("this CPU has no {isa_name} path").into());
    }
    for _ in 0..reps {
        let t = kernels::bench(isa, format, columns, 1536, rows, copies)?;
        println!(
            "{format} rows={rows} copies={copies}: {:.3} ms {:.1} G MAC/s; kernel alone {:.3} ms {:.1} G MAC/s",
            t.ns / 1e6,
            t.gmacs,
            t.kernel_ns / 1e6,
            t.kernel_gmacs
        );
    }
    Ok(())
}
