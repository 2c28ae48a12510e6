//! The per-session KV cache: append, keep-only-these (path compaction), truncate.
//!
//! Each layer holds one K and one V tensor of shape `(kv_heads, allocated, head_dim)`. New
//! entries are written in place (`slice_set`) and attention reads a narrowed view of the live
//! prefix, so a step never copies the whole cache. The allocation grows in chunks (doubling, at
//! least [`GROW_CHUNK`] positions) up to the context limit, so an idle session does not hold
//! hundreds of MB; going past the limit is an [`EngineError::ContextFull`], never a panic.
//!
//! Entry `j` of the cache holds the token at position `j`; tree nodes are appended in BFS order,
//! so after a tree forward the newest `n` entries are the nodes (at positions
//! `prefix + depth`). Compacting to the accepted root-to-leaf path ([`KvCache::keep_newest`])
//! puts node of depth `d` at entry `prefix + d`, matching the position it was encoded with.

use candle_core::{DType, Device, Tensor};

use super::EngineError;

/// Smallest allocation step, in positions.
pub const GROW_CHUNK: usize = 256;

#[derive(Debug)]
pub(crate) struct LayerKv {
    pub k: Tensor,
    pub v: Tensor,
}

/// Keys and values of one sequence for every layer of one model.
#[derive(Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerKv>,
    len: usize,
    allocated: usize,
    limit: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl KvCache {
    pub(crate) fn new(
        n_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        limit: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        let empty = || Tensor::zeros((kv_heads, 0, head_dim), dtype, device);
        let layers = (0..n_layers)
            .map(|_| {
                // Zero-sized tensors cannot fail to allocate.
                LayerKv {
                    k: empty().expect("empty tensor"),
                    v: empty().expect("empty tensor"),
                }
            })
            .collect();
        Self {
            layers,
            len: 0,
            allocated: 0,
            limit,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        }
    }

    /// Committed plus appended tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most tokens this cache can hold (the model's context limit).
    pub fn capacity(&self) -> usize {
        self.limit
    }

    /// Positions currently allocated (grows on demand up to [`capacity`](Self::capacity)).
    pub fn allocated(&self) -> usize {
        self.allocated
    }

    /// Drop every entry from `len` on (no-op if `len >= self.len()`).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Of the newest `n` entries, keep only those at `keep` (indices into those `n`, strictly
    /// ascending), moved down in order; drop the rest. With `keep` = the accepted path of a
    /// verified tree (node indices, BFS order), the cache ends with exactly that path.
    pub fn keep_newest(&mut self, n: usize, keep: &[usize]) -> Result<(), EngineError> {
        if n > self.len {
            return Err(EngineError::InvalidInput(format!(
                "keep_newest: n = {n} but the cache holds only {} entries",
                self.len
            )));
        }
        if let Some(w) = keep.windows(2).find(|w| w[0] >= w[1]) {
            return Err(EngineError::InvalidInput(format!(
                "keep_newest: indices must be strictly ascending, got {} then {}",
                w[0], w[1]
            )));
        }
        if let Some(&bad) = keep.iter().find(|&&i| i >= n) {
            return Err(EngineError::InvalidInput(format!(
                "keep_newest: index {bad} out of range 0..{n}"
            )));
        }
        let base = self.len - n;
        // Entries already in place (a prefix 0, 1, ..) need no move.
        let moved_from = keep
            .iter()
            .enumerate()
            .position(|(j, &i)| i != j)
            .unwrap_or(keep.len());
        if moved_from < keep.len() {
            let src: Vec<u32> = keep[moved_from..]
                .iter()
                .map(|&i| (base + i) as u32)
                .collect();
            let idx = Tensor::from_vec(src, keep.len() - moved_from, &self.device)?;
            for layer in &mut self.layers {
                for t in [&mut layer.k, &mut layer.v] {
                    // Gather into a fresh tensor first: slice_set cannot read its own storage.
                    let rows = t.index_select(&idx, 1)?;
                    t.slice_set(&rows, 1, base + moved_from)?;
                }
            }
        }
        self.len = base + keep.len();
        Ok(())
    }

    /// A deep copy (independent storage), e.g. to branch a session.
    pub fn fork(&self) -> Result<KvCache, EngineError> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKv {
                    k: l.k.copy()?,
                    v: l.v.copy()?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        Ok(KvCache {
            layers,
            len: self.len,
            allocated: self.allocated,
            limit: self.limit,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: self.dtype,
            device: self.device.clone(),
        })
    }

    /// Take this cache over for a new sequence whose first `keep` tokens equal the first
    /// `keep` tokens this cache holds (prefix reuse across chat turns; the caller compares the
    /// tokens). Entries from `keep` on are dropped and the cache gets a new size `limit`;
    /// storage beyond `limit` is given back, so memory stays within what the new owner
    /// reserved. The kept entries are untouched, so the logits after forwarding the rest of the
    /// sequence are those of a fresh prefill of all of it (batch-invariant kernels; tested in
    /// shared/engine/tests/prefix_reuse.rs).
    pub fn reuse_prefix(&mut self, keep: usize, limit: usize) -> Result<(), EngineError> {
        if keep > self.len {
            return Err(EngineError::InvalidInput(format!(
                "reuse_prefix: keep = {keep} but the cache holds only {} entries",
                self.len
            )));
        }
        if keep > limit {
            return Err(EngineError::ContextFull {
                needed: keep,
                limit,
            });
        }
        self.len = keep;
        self.limit = limit;
        if self.allocated > limit {
            self.shrink_allocation(limit)?;
        }
        Ok(())
    }

    /// Give back the storage past the live entries (a cache kept for later reuse holds only
    /// what it can give).
    pub fn shrink_to_fit(&mut self) -> Result<(), EngineError> {
        if self.allocated > self.len {
            self.shrink_allocation(self.len)?;
        }
        Ok(())
    }

    /// Bytes of K and V storage this cache holds now.
    pub fn allocated_bytes(&self) -> usize {
        2 * self.layers.len()
            * self.kv_heads
            * self.head_dim
            * self.allocated
            * self.dtype.size_in_bytes()
    }

    fn shrink_allocation(&mut self, to: usize) -> Result<(), EngineError> {
        for layer in &mut self.layers {
            for t in [&mut layer.k, &mut layer.v] {
                // A narrowed view would keep the whole storage alive: copy it out.
                *t = t.narrow(1, 0, to)?.force_contiguous()?;
            }
        }
        self.allocated = to;
        Ok(())
    }

    /// Make room for `needed` entries in total, or fail with `ContextFull`.
    pub(crate) fn reserve(&mut self, needed: usize) -> Result<(), EngineError> {
        if needed > self.limit {
            return Err(EngineError::ContextFull {
                needed,
                limit: self.limit,
            });
        }
        if needed <= self.allocated {
            return Ok(());
        }
        let target = needed
            .max(self.allocated * 2)
            .max(GROW_CHUNK)
            .next_multiple_of(GROW_CHUNK)
            .min(self.limit);
        let extra = target - self.allocated;
        for layer in &mut self.layers {
            for t in [&mut layer.k, &mut layer.v] {
                let pad = Tensor::zeros(
                    (self.kv_heads, extra, self.head_dim),
                    self.dtype,
                    &self.device,
                )?;
                *t = Tensor::cat(&[&*t, &pad], 1)?;
            }
        }
        self.allocated = target;
        Ok(())
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.allocated);
        self.len = len;
    }

    /// Whether this cache was made for a model with this geometry.
    pub(crate) fn fits(&self, n_layers: usize, kv_heads: usize, head_dim: usize) -> bool {
        self.layers.len() == n_layers && self.kv_heads == kv_heads && self.head_dim == head_dim
    }
}
