//! The tree shapes this draft node uses: the Sequoia DP solved once at start-up for the
//! configured acceptance vector and budget, with smaller trees ready for when the context is
//! nearly full.

use crate::config::TreeConfig;
use sequoia_shared::planner::{PlanError, SequoiaDp};
use sequoia_shared::tree::Tree;

pub struct TreePlanner {
    /// trees[k] = best tree with at most k + 1 nodes.
    trees: Vec<Tree>,
    expected: f64,
}

impl TreePlanner {
    pub fn new(cfg: &TreeConfig) -> Result<Self, PlanError> {
        let nodes = cfg.nodes.max(1);
        let dp = SequoiaDp::solve(&cfg.acceptance, nodes, cfg.max_levels.max(1))?;
        let trees = (1..=nodes).map(|n| dp.tree(n, cfg.max_levels)).collect();
        Ok(Self {
            trees,
            expected: dp.expected(nodes, cfg.max_levels),
        })
    }

    /// The planned tree, shrunk to at most `room` nodes.
    pub fn shape(&self, room: usize) -> &Tree {
        let k = room.clamp(1, self.trees.len()) - 1;
        &self.trees[k]
    }

    /// Expected tokens per step of the full-size tree under the configured acceptance vector.
    pub fn expected_tokens(&self) -> f64 {
        self.expected
    }
}
