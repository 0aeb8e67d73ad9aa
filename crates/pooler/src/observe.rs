//! The agent's view of its cluster: watches (not polls) of the cluster's Lease and instance
//! pods into local caches, and [`observed`], which reads them into a [`decide::Observed`].
//!
//! Each watch runs in its own task and rings a [`Notify`] on every event, so the agent's loop
//! reacts at once and the watches keep running while a step (a `PAUSE`) blocks the loop.
//!
//! [`decide::Observed`]: crate::decide::Observed

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::contract::{self, InstanceStatus, STATUS_ANNOTATION, pooler::PAUSE_ANNOTATION};
use crate::decide::{Instance, Observed};

/// The caches of the two watches, and their tasks (aborted when dropped).
pub struct Watches {
    pub lease: Store<Lease>,
    pub pods: Store<Pod>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Watches {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Watches {
    /// What the caches hold now.
    pub fn observed(&self) -> Observed {
        let lease = self.lease.state().into_iter().next();
        observed(lease.as_deref(), self.pods.state().iter().map(Arc::as_ref))
    }
}

/// Starts watching `cluster`'s Lease (by name) and instance pods (by
/// [`contract::CLUSTER_LABEL`]) in `namespace`; `changed` is notified on each event.
///
/// # Caveats
/// The watches retry with kube's default backoff and never end; errors are logged. Until a
/// watch listed once its cache is empty (no primary known, no pause asked for).
pub fn watch(
    client: kube::Client,
    namespace: &str,
    cluster: &str,
    changed: Arc<Notify>,
) -> Watches {
    let (lease, lease_writer) = reflector::store::<Lease>();
    let (pods, pods_writer) = reflector::store::<Pod>();
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let pod_api: Api<Pod> = Api::namespaced(client, namespace);
    let by_name = watcher::Config::default()
        .fields(&format!("metadata.name={}", contract::lease_name(cluster)));
    let by_label =
        watcher::Config::default().labels(&format!("{}={cluster}", contract::CLUSTER_LABEL));
    let lease_stream =
        reflector::reflector(lease_writer, watcher(leases, by_name)).default_backoff();
    let pod_stream =
        reflector::reflector(pods_writer, watcher(pod_api, by_label)).default_backoff();
    let tasks = vec![
        tokio::spawn(drive("Lease", lease_stream, changed.clone())),
        tokio::spawn(drive("pods", pod_stream, changed)),
    ];
    Watches { lease, pods, tasks }
}

async fn drive<S, K>(what: &'static str, stream: S, changed: Arc<Notify>)
where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(_) => changed.notify_one(),
            Err(e) => tracing::warn!(watch = what, error = %e, "watch failed; retrying"),
        }
    }
}

/// The observation from the Lease (if any) and the instance pods.
pub fn observed<'a>(lease: Option<&Lease>, pods: impl IntoIterator<Item = &'a Pod>) -> Observed {
    let holder = lease
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty());
    let pause = lease
        .and_then(|l| l.metadata.annotations.as_ref())
        .and_then(|a| a.get(PAUSE_ANNOTATION))
        .cloned();
    let pods = pods
        .into_iter()
        .filter_map(|pod| Some((pod.metadata.name.clone()?, instance(pod))))
        .collect();
    Observed {
        holder,
        pause,
        pods,
    }
}

/// One pod's IP and published role (none when its status annotation is missing or unreadable).
fn instance(pod: &Pod) -> Instance {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .filter(|ip| !ip.is_empty());
    let role = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(STATUS_ANNOTATION))
        .and_then(|json| serde_json::from_str::<InstanceStatus>(json).ok())
        .map(|status| status.role);
    Instance { ip, role }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Role;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::api::core::v1::PodStatus;
    use kube::api::ObjectMeta;

    fn lease(holder: Option<&str>, pause: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("pg-primary".into()),
                annotations: pause.map(|p| [(PAUSE_ANNOTATION.to_string(), p.to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                ..LeaseSpec::default()
            }),
        }
    }

    fn pod(name: &str, ip: Option<&str>, status: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: status
                    .map(|s| [(STATUS_ANNOTATION.to_string(), s.to_string())].into()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                pod_ip: ip.map(String::from),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    const PRIMARY: &str = r#"{"role":"primary","timeline":1,"lsn":"0/3000060","replayLag":0}"#;
    const REPLICA: &str = r#"{"role":"replica","timeline":1,"lsn":"0/3000060","replayLag":0}"#;

    #[test]
    fn the_lease_and_pods_read_into_an_observation() {
        let pods = [
            pod("pg-0", Some("10.0.0.10"), Some(PRIMARY)),
            pod("pg-1", Some("10.0.0.11"), Some(REPLICA)),
            pod("pg-2", None, Some("not json")),
        ];
        let seen = observed(Some(&lease(Some("pg-0"), Some("pg-1/17"))), &pods);
        assert_eq!(seen.holder.as_deref(), Some("pg-0"));
        assert_eq!(seen.pause.as_deref(), Some("pg-1/17"));
        assert_eq!(seen.pods["pg-0"].role, Some(Role::Primary));
        assert_eq!(seen.pods["pg-1"].ip.as_deref(), Some("10.0.0.11"));
        assert_eq!(seen.pods["pg-2"], Instance::default());
        assert_eq!(
            seen.primary(),
            Some(crate::config::Target::Pod {
                name: "pg-0".into(),
                ip: "10.0.0.10".into()
            })
        );
    }

    #[test]
    fn no_lease_or_an_empty_holder_is_no_holder() {
        let pods = [pod("pg-0", Some("10.0.0.10"), Some(PRIMARY))];
        assert_eq!(observed(None, &pods).holder, None);
        assert_eq!(observed(Some(&lease(Some(""), None)), &pods).holder, None);
        assert_eq!(observed(Some(&lease(None, None)), &pods).pause, None);
    }
}
