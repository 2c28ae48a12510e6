//! Which machine and which CPUs a service runs on, so that a draft node can tell whether a
//! verify node competes with it for the same cores (both on one machine with overlapping CPU
//! sets). Pipelined drafting pays only when it does not: the work it does ahead of a verdict
//! would otherwise take cores from the verification it overlaps (measured on one 2-core host:
//! 0.90× the target alone with it, 1.03× without, docs/ALGORITHMS.md §10).

use std::collections::BTreeSet;

/// An id shared by every process of one running kernel: the boot id on Linux (the same inside
/// containers and network namespaces of one machine). None where there is no such file.
pub fn machine_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_string())
}

/// The CPUs this process may run on (`Cpus_allowed_list` of /proc/self/status); empty where it
/// cannot be read.
pub fn allowed_cpus() -> Vec<u32> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|list| parse_cpu_list(list.trim()))
        })
        .unwrap_or_default()
}

/// Parse a kernel CPU list such as `0-3,8,10-11`; None if it is malformed.
pub fn parse_cpu_list(list: &str) -> Option<Vec<u32>> {
    let mut cpus = BTreeSet::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 65_536 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => {
                cpus.insert(part.parse().ok()?);
            }
        }
    }
    Some(cpus.into_iter().collect())
}

/// Whether a process on (`machine`, `cpus`) shares cores with this one: same machine and at
/// least one CPU both may run on. Unknown (an empty id or CPU list, e.g. an older node) counts as
/// not shared.
pub fn shares_cpus_with_this_process(machine: &str, cpus: &[u32]) -> bool {
    let (Some(own), false) = (machine_id(), machine.is_empty() || cpus.is_empty()) else {
        return false;
    };
    own == machine && overlap(&allowed_cpus(), cpus)
}

fn overlap(a: &[u32], b: &[u32]) -> bool {
    a.iter().any(|c| b.contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_the_kernel_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("1"), Some(vec![1]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a-b"), None);
        assert_eq!(parse_cpu_list("0-99999999"), None);
    }

    #[test]
    fn this_process_shares_its_own_cpus_and_not_another_machines() {
        let cpus = allowed_cpus();
        let id = machine_id();
        if cfg!(target_os = "linux") {
            assert!(
                !cpus.is_empty(),
                "Cpus_allowed_list should be readable on Linux"
            );
            assert!(id.is_some(), "the boot id should be readable on Linux");
        }
        if let Some(id) = id {
            assert!(shares_cpus_with_this_process(&id, &cpus));
            assert!(!shares_cpus_with_this_process("another-machine", &cpus));
            // Same machine, disjoint CPU sets (e.g. the two-host emulation's pinned halves).
            let other: Vec<u32> = (0..4096).filter(|c| !cpus.contains(c)).take(1).collect();
            assert!(!shares_cpus_with_this_process(&id, &other));
            // An older node reports nothing: not shared.
            assert!(!shares_cpus_with_this_process("", &cpus));
            assert!(!shares_cpus_with_this_process(&id, &[]));
        }
    }
}
