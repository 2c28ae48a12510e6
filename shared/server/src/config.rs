//! Layered service configuration: defaults < TOML file < `SEQUOIA_*` environment < CLI flags.
//!
//! Each service defines a serde struct with defaults; [`load`] merges the layers with figment.
//! Nested keys use `__` in the environment (`SEQUOIA_TREE__NODES=32` sets `tree.nodes`).

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{de::DeserializeOwned, Serialize};
use std::path::Path;

/// Environment variable prefix for every setting.
pub const ENV_PREFIX: &str = "SEQUOIA_";

/// A configuration that could not be assembled.
#[derive(Debug, thiserror::Error)]
#[error("configuration error: {0}")]
pub struct ConfigError(String);

/// Merge `defaults`, then the TOML `file` (must exist when given), then `SEQUOIA_*` variables,
/// then `overrides` (CLI flags serialized with unset flags skipped).
pub fn load<C, O>(defaults: &C, file: Option<&Path>, overrides: &O) -> Result<C, ConfigError>
where
    C: Serialize + DeserializeOwned,
    O: Serialize,
{
    let mut fig = Figment::from(Serialized::defaults(defaults));
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigError(format!(
                "config file {} does not exist",
                path.display()
            )));
        }
        fig = fig.merge(Toml::file(path));
    }
    fig = fig
        .merge(Env::prefixed(ENV_PREFIX).split("__"))
        .merge(Serialized::defaults(overrides));
    fig.extract().map_err(|e| ConfigError(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Conf {
        listen: String,
        nodes: usize,
        inner: Inner,
    }
    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Inner {
        width: usize,
    }
    #[derive(Serialize, Default)]
    struct Flags {
        #[serde(skip_serializing_if = "Option::is_none")]
        nodes: Option<usize>,
    }

    #[test]
    fn layers_override_in_order() {
        let d = Conf {
            listen: "a".into(),
            nodes: 1,
            inner: Inner { width: 2 },
        };
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "listen = \"file\"\nnodes = 5\n[inner]\nwidth = 9\n").unwrap();
        figment::Jail::expect_with(|jail| {
            jail.set_env("SEQUOIA_NODES", "7");
            let c: Conf = load(&d, Some(&f), &Flags::default()).unwrap();
            assert_eq!(
                c,
                Conf {
                    listen: "file".into(),
                    nodes: 7,
                    inner: Inner { width: 9 }
                }
            );
            let c: Conf = load(&d, Some(&f), &Flags { nodes: Some(11) }).unwrap();
            assert_eq!(c.nodes, 11);
            jail.set_env("SEQUOIA_INNER__WIDTH", "3");
            let c: Conf = load(&d, None, &Flags::default()).unwrap();
            assert_eq!(c.inner.width, 3);
            assert_eq!(c.listen, "a");
            Ok(())
        });
        assert!(load(&d, Some(Path::new("/nonexistent.toml")), &Flags::default()).is_err());
    }
}

/// Keys of a TOML file that the configuration type `defaults` does not have (dotted paths).
/// Used by tests to keep the documented example configs in step with the code.
pub fn unknown_keys<C: Serialize>(defaults: &C, file: &Path) -> Result<Vec<String>, ConfigError> {
    let known = serde_json::to_value(defaults).map_err(|e| ConfigError(e.to_string()))?;
    let given: serde_json::Value = Figment::from(Toml::file(file))
        .extract()
        .map_err(|e| ConfigError(e.to_string()))?;
    let mut out = Vec::new();
    collect_unknown(&known, &given, "", &mut out);
    Ok(out)
}

fn collect_unknown(
    known: &serde_json::Value,
    given: &serde_json::Value,
    at: &str,
    out: &mut Vec<String>,
) {
    if let (Some(k), Some(g)) = (known.as_object(), given.as_object()) {
        for (key, value) in g {
            let path = if at.is_empty() {
                key.clone()
            } else {
                format!("{at}.{key}")
            };
            match k.get(key) {
                None => out.push(path),
                Some(kv) => collect_unknown(kv, value, &path, out),
            }
        }
    }
}
