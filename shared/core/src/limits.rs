//! Every size limit the draft and verify sides must agree on, in one place.
//!
//! The verify side's configurable limits (`max_tree_nodes`, `max_tree_levels`,
//! `max_dist_entries`) default to these values; the draft side never builds or accepts a tree
//! beyond them, so a tree the draft sends is never refused for its shape by a default verify
//! node.

/// Most nodes in one tree (root included): draft `tree.nodes`, forced trees, verify default.
pub const MAX_TREE_NODES: usize = 512;
/// Most levels in one tree (root = 1 level): draft `tree.max_levels`, forced trees, verify
/// default. The planner searches no deeper.
pub const MAX_TREE_LEVELS: usize = 32;
/// Most entries in one node's sparse draft distribution on the wire (verify default).
pub const MAX_DIST_ENTRIES: usize = 1024;
/// Largest node budget the cost-model search considers (a bound on its work, above any
/// configurable tree size).
pub const MAX_PLANNED_NODES: usize = 1024;
/// Most stop strings in one request, and the longest one in bytes.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// Largest gRPC message either service sends or accepts (a 512-node tree with 64-entry
/// distributions is about 0.4 MB; prompts of a 32k context are well under this).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;
/// How often one generation may move to another verify node before giving up.
pub const MAX_FAILOVERS: u32 = 8;

/// The tree limits as [`crate::tree::TreeLimits`].
pub const TREE: crate::tree::TreeLimits = crate::tree::TreeLimits {
    max_nodes: MAX_TREE_NODES,
    max_levels: MAX_TREE_LEVELS,
};
