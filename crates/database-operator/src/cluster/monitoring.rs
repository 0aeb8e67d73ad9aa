//! `spec.monitoring.queriesConfigMap`: whether the metrics queries it holds can be served,
//! checked with the same parser the instance managers use, and told by the condition
//! [`METRICS_QUERIES`]. A bad or missing ConfigMap never stops PostgreSQL (its volume is
//! optional, and the instances serve the built-in metrics and the files that parse).

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use steward_core::conditions::Wanted;
use steward_database_api::monitoring;

use crate::Error;
use crate::crd::PostgresCluster;

/// The condition type.
pub const METRICS_QUERIES: &str = "MetricsQueries";

/// What the queries' ConfigMap amounts to.
#[derive(Clone, Debug, PartialEq)]
pub enum Queries {
    /// `spec.monitoring.queriesConfigMap` is unset.
    NotAsked,
    Missing {
        config_map: String,
    },
    Invalid {
        config_map: String,
        key: String,
        why: String,
    },
    Serving {
        config_map: String,
        queries: usize,
    },
}

/// The ConfigMap `spec.monitoring.queriesConfigMap` names, if any, and what was read.
///
/// # Errors
/// [`Error::Read`] when it cannot be read.
pub async fn observe(
    client: &kube::Client,
    namespace: &str,
    cluster: &PostgresCluster,
) -> Result<Queries, Error> {
    let Some(name) = asked(cluster) else {
        return Ok(Queries::NotAsked);
    };
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let found = config_maps
        .get_opt(name)
        .await
        .map_err(|source| Error::Read {
            what: format!("ConfigMap {name} (spec.monitoring.queriesConfigMap)"),
            source,
        })?;
    Ok(decide(name, found.as_ref()))
}

fn asked(cluster: &PostgresCluster) -> Option<&str> {
    cluster
        .spec
        .monitoring
        .as_ref()
        .and_then(|m| m.queries_config_map.as_deref())
}

/// Checks every key of `found` as the instance managers read it: each a YAML list of
/// queries, no name taken twice or from the built-in queries.
pub fn decide(name: &str, found: Option<&ConfigMap>) -> Queries {
    let config_map = name.to_string();
    let Some(found) = found else {
        return Queries::Missing { config_map };
    };
    let keys = found
        .data
        .iter()
        .flatten()
        .map(|(key, text)| (key.as_str(), text.as_str()));
    let (queries, left_out) = monitoring::from_keys(keys, monitoring::builtin());
    match left_out.into_iter().next() {
        Some((key, why)) => Queries::Invalid {
            config_map,
            key,
            why,
        },
        None => Queries::Serving {
            config_map,
            queries: queries.len(),
        },
    }
}

impl Queries {
    /// The condition to set (`None`: remove it).
    pub fn condition(&self) -> Option<Wanted> {
        match self {
            Queries::NotAsked => None,
            Queries::Missing { config_map } => Some(Wanted::fails(
                "ConfigMapMissing",
                format!(
                    "spec.monitoring.queriesConfigMap: ConfigMap {config_map} does not exist; the instances serve the built-in metrics only"
                ),
            )),
            Queries::Invalid {
                config_map,
                key,
                why,
            } => Some(Wanted::fails(
                "QueriesInvalid",
                format!(
                    "spec.monitoring.queriesConfigMap: key {key} of ConfigMap {config_map}: {why}; the instances serve the built-in metrics and the keys that are valid"
                ),
            )),
            Queries::Serving {
                config_map,
                queries,
            } => Some(Wanted::holds(
                "Serving",
                format!("{queries} queries of ConfigMap {config_map} are served"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn config_map(data: &[(&str, &str)]) -> ConfigMap {
        ConfigMap {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn the_queries_config_map_is_checked_key_by_key() {
        assert_eq!(
            decide("q", None),
            Queries::Missing {
                config_map: "q".into()
            }
        );
        let good = "- {name: app_orders, query: select 1 as n, metrics: [{column: n}]}";
        assert_eq!(
            decide("q", Some(&config_map(&[("a.yaml", good)]))),
            Queries::Serving {
                config_map: "q".into(),
                queries: 1
            }
        );
        // The same name in two keys is a clash, named on the second key.
        match decide(
            "q",
            Some(&config_map(&[("a.yaml", good), ("b.yaml", good)])),
        ) {
            Queries::Invalid { key, why, .. } => {
                assert_eq!(key, "b.yaml");
                assert!(why.contains("used twice"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        let Wanted {
            status: ok,
            reason,
            message,
        } = decide("q", Some(&config_map(&[("a.yaml", "- {name: x")])))
            .condition()
            .unwrap_or_else(|| panic!("a condition"));
        assert!(!ok);
        assert_eq!(reason, "QueriesInvalid");
        assert!(
            message.starts_with("spec.monitoring.queriesConfigMap: key a.yaml"),
            "{message}"
        );
        assert_eq!(Queries::NotAsked.condition(), None);
    }
}
