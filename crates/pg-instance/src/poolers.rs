//! The primary's side of a paused switchover ([`contract::pooler`]): before it stops for a
//! planned switchover, it names a pause on the Lease and waits until every ready pooler pod
//! has acknowledged it in the state ConfigMap (its PgBouncer finished the running
//! transactions and holds new ones). Without poolers nothing is written and nothing waits.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use tokio::time::Instant;

use crate::contract::pooler;

/// The pooler pods a pause waits for: running, ready and not being deleted. One that is not
/// ready serves no client; when it becomes ready its agent reads the pause from the Lease
/// before its PgBouncer reaches any server.
pub fn awaited(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .map(ResourceExt::name_any)
        .collect()
}

/// The pods of `awaited` that have not acknowledged `pause` in the state ConfigMap's `data`.
pub fn missing(
    awaited: &[String],
    acks: Option<&BTreeMap<String, String>>,
    pause: &str,
) -> Vec<String> {
    awaited
        .iter()
        .filter(|pod| acks.and_then(|a| a.get(*pod)).map(String::as_str) != Some(pause))
        .cloned()
        .collect()
}

/// A new pause's name: the target and the time, so no acknowledgement of an earlier one
/// counts.
pub fn pause_name(target: &str) -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{target}/{millis}")
}

/// The ready pooler pods of `cluster`.
///
/// # Errors
/// The API server's, or a timeout.
pub async fn list(
    pods: &Api<Pod>,
    cluster: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<String>> {
    let selector = format!("{}={cluster}", pooler::LABEL);
    let list = tokio::time::timeout(timeout, pods.list(&ListParams::default().labels(&selector)))
        .await??;
    Ok(awaited(&list.items))
}

/// Waits (up to [`pooler::PAUSE_WAIT`]) until every pod of `awaited` acknowledged `pause`.
/// Returns why not otherwise.
pub async fn wait_for_acks(
    config_maps: &Api<ConfigMap>,
    cluster: &str,
    awaited: &[String],
    pause: &str,
    api_timeout: Duration,
) -> Result<Duration, String> {
    let started = Instant::now();
    let deadline = started + pooler::PAUSE_WAIT;
    let name = pooler::state_config_map(cluster);
    let mut last;
    loop {
        match tokio::time::timeout(api_timeout, config_maps.get_opt(&name)).await {
            Ok(Ok(state)) => {
                let left = missing(awaited, state.as_ref().and_then(|c| c.data.as_ref()), pause);
                if left.is_empty() {
                    return Ok(started.elapsed());
                }
                last = format!("not paused: {}", left.join(", "));
            }
            Ok(Err(e)) => last = format!("reading ConfigMap {name} failed: {e}"),
            Err(_) => last = format!("reading ConfigMap {name} timed out"),
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the poolers did not pause within {:?} ({last}): a transaction that does not end, or an agent that does not answer",
                pooler::PAUSE_WAIT
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};

    fn pod(name: &str, ready: bool) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.status = Some(PodStatus {
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        p
    }

    #[test]
    fn a_pause_waits_for_every_ready_pooler_and_only_its_own_acknowledgement() {
        let waiting = awaited(&[pod("a", true), pod("b", true), pod("c", false)]);
        assert_eq!(waiting, vec!["a", "b"]);
        let acks = BTreeMap::from([
            ("a".to_string(), "pg-1/2".to_string()),
            ("b".to_string(), "pg-1/1".to_string()),
        ]);
        // b acknowledged an earlier pause: not this one.
        assert_eq!(missing(&waiting, Some(&acks), "pg-1/2"), vec!["b"]);
        assert_eq!(missing(&waiting, None, "pg-1/2"), vec!["a", "b"]);
        assert!(missing(&[], None, "x").is_empty());
        assert!(pause_name("pg-1").starts_with("pg-1/"));
    }
}
