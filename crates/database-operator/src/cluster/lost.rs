//! Instances whose volume is gone: a local volume pins its instance to one node, so when that
//! node is gone for good (its Node object deleted, as an administrator or a cloud's node
//! controller does for a machine that will not return) or the volume itself is (its
//! PersistentVolume deleted, the claim `Lost`), the StatefulSet's pod stays Pending for ever
//! (nothing can schedule it) and the cluster runs one instance short. The operator deletes
//! that instance's claim, then its pod: the StatefulSet makes both again, the new claim gets a
//! volume wherever the scheduler places the pod, and the instance clones the primary. A pod
//! whose claim is gone (deleted by hand, or an operator killed between the two deletes) is
//! replaced the same way: the StatefulSet makes a missing claim only with a new pod.
//!
//! Only a replica is replaced, and only while a ready primary runs elsewhere (its clone's
//! source): the primary's own volume gone is a failover first (the instance managers elect a
//! replica once the Lease expires), and with no primary running nothing is deleted, since the
//! claim may hold the only copy of the data.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::{Client, ResourceExt};
use steward_core::object::unless_gone;

use super::build::DATA_VOLUME;
use super::rollout::PodView;
use crate::Error;

/// The label a local volume's node affinity names its node by.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// Where an unscheduled instance's volume is, as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Volume {
    /// Bound to a volume pinned to these nodes (`kubernetes.io/hostname` values), none of
    /// which exists any more (no Node carries the label).
    OnGoneNodes(BTreeSet<String>),
    /// Its PersistentVolume `0` is deleted, or the claim is `Lost`.
    Gone(String),
    /// Its claim `0` is gone: deleted (by hand, or by a replacement interrupted before it
    /// deleted the pod); the StatefulSet makes it again only with a new pod.
    ClaimGone(String),
    /// Present, or not pinned to any node: nothing to do.
    Present,
}

/// An instance whose pod is Pending with no node, and its volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unscheduled {
    pub pod: String,
    pub volume: Volume,
    /// Its claim's uid (deleted only if it is still that claim).
    pub claim_uid: Option<String>,
    /// Its pod's uid (deleted only if it is still that pod).
    pub pod_uid: Option<String>,
}

/// What to do about the instances whose volume is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Delete `pod`'s claim, then the pod: the StatefulSet makes both again.
    Replace {
        pod: String,
        why: String,
    },
    /// `pod`'s volume is gone, but it cannot be replaced now (`why`).
    Blocked {
        pod: String,
        why: String,
    },
    Nothing,
}

impl Volume {
    fn lost(&self) -> Option<String> {
        match self {
            Volume::OnGoneNodes(nodes) => Some(format!(
                "its volume is on node {}, which is gone (its Node was deleted)",
                nodes.iter().cloned().collect::<Vec<_>>().join(", ")
            )),
            Volume::Gone(pv) => Some(format!("its volume {pv} is gone")),
            Volume::ClaimGone(claim) => Some(format!("its claim {claim} is gone")),
            Volume::Present => None,
        }
    }
}

/// The first instance (lowest ordinal) of `unscheduled` whose volume is gone: replaced if a
/// ready primary (the Lease's `primary`) runs to clone from and it is not that primary.
pub fn decide(primary: Option<&str>, pods: &[PodView], unscheduled: &[Unscheduled]) -> Decision {
    let ordinal = |name: &str| pods.iter().find(|p| p.name == name).map(|p| p.ordinal);
    let Some((pod, why)) = unscheduled
        .iter()
        .filter_map(|u| Some((u, u.volume.lost()?)))
        .min_by_key(|(u, _)| ordinal(&u.pod))
        .map(|(u, why)| (u.pod.clone(), why))
    else {
        return Decision::Nothing;
    };
    if primary == Some(pod.as_str()) {
        return Decision::Blocked {
            pod,
            why: format!(
                "{why}; it still holds the primary's Lease: a replica is elected once the Lease expires, then it is replaced"
            ),
        };
    }
    let running =
        primary.is_some_and(|p| pods.iter().any(|v| v.name == p && v.ready && !v.deleting));
    if !running {
        return Decision::Blocked {
            pod,
            why: format!(
                "{why}; not replaced while no primary runs to clone it from (its claim is kept: it may hold the only copy)"
            ),
        };
    }
    Decision::Replace {
        why: format!(
            "{why}: deleting its claim and pod, so the StatefulSet re-creates it with a new volume and it clones the primary {}",
            primary.unwrap_or_default()
        ),
        pod,
    }
}

/// The cluster's instances whose pods are Pending with no node (`pods`, in namespace `ns`),
/// with where their volumes are; and the nodes those volumes are pinned to (a change of one
/// wakes the cluster). Reads nothing while every pod is scheduled.
///
/// # Errors
/// [`Error::Read`] naming the claim, volume or Node that could not be read.
pub async fn observe(
    client: &Client,
    ns: &str,
    pods: &[Pod],
) -> Result<(Vec<Unscheduled>, BTreeSet<String>), Error> {
    let mut unscheduled = Vec::new();
    let mut pinned_to = BTreeSet::new();
    let waiting = pods.iter().filter(|p| {
        p.metadata.deletion_timestamp.is_none()
            && p.spec.as_ref().is_some_and(|s| s.node_name.is_none())
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending")
    });
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let volumes: Api<PersistentVolume> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let read = |what: String| move |source| Error::Read { what, source };
    for pod in waiting {
        let name = format!("{DATA_VOLUME}-{}", pod.name_any());
        let Some(claim) = claims
            .get_opt(&name)
            .await
            .map_err(read(format!("PersistentVolumeClaim {name}")))?
        else {
            // The StatefulSet creates a pod's claim before the pod: this one was deleted
            // since (a replacement cut off between its two deletes, say).
            unscheduled.push(Unscheduled {
                pod: pod.name_any(),
                volume: Volume::ClaimGone(name),
                claim_uid: None,
                pod_uid: pod.uid(),
            });
            continue;
        };
        if claim.metadata.deletion_timestamp.is_some() {
            // Going (an unscheduled pod does not hold it): seen as gone once it is.
            continue;
        }
        let lost = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Lost");
        let bound = claim.spec.as_ref().and_then(|s| s.volume_name.clone());
        let volume = match bound {
            _ if lost => Volume::Gone(name.clone()),
            None => Volume::Present,
            Some(pv) => match volumes
                .get_opt(&pv)
                .await
                .map_err(read(format!("PersistentVolume {pv}")))?
            {
                None => Volume::Gone(pv),
                Some(volume) => {
                    let pinned = pinned_nodes(&volume);
                    let mut any_left = pinned.is_empty();
                    for node in &pinned {
                        if !any_left {
                            // By the label the affinity matches, not by name: a node's
                            // hostname label need not be its name.
                            let selector = ListParams::default()
                                .labels(&format!("{HOSTNAME_LABEL}={node}"))
                                .limit(1);
                            any_left = !nodes
                                .list_metadata(&selector)
                                .await
                                .map_err(read(format!(
                                    "the Node labelled {HOSTNAME_LABEL}={node}"
                                )))?
                                .items
                                .is_empty();
                        }
                    }
                    pinned_to.extend(pinned.iter().cloned());
                    if any_left {
                        Volume::Present
                    } else {
                        Volume::OnGoneNodes(pinned)
                    }
                }
            },
        };
        unscheduled.push(Unscheduled {
            pod: pod.name_any(),
            volume,
            claim_uid: claim.uid(),
            pod_uid: pod.uid(),
        });
    }
    Ok((unscheduled, pinned_to))
}

/// The nodes a volume is pinned to: the `kubernetes.io/hostname` values its required node
/// affinity allows, when every term names some (a local volume); none otherwise.
fn pinned_nodes(volume: &PersistentVolume) -> BTreeSet<String> {
    let terms = volume
        .spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref()?.required.as_ref())
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default();
    let mut nodes = BTreeSet::new();
    for term in terms {
        let named: Vec<&String> = term
            .match_expressions
            .iter()
            .flatten()
            .filter(|e| e.key == HOSTNAME_LABEL && e.operator == "In")
            .flat_map(|e| e.values.iter().flatten())
            .collect();
        if named.is_empty() {
            return BTreeSet::new();
        }
        nodes.extend(named.into_iter().cloned());
    }
    nodes
}

/// Deletes `lost`'s claim, then its pod (each only if it is still the one observed): the
/// StatefulSet makes both again.
///
/// # Errors
/// [`Error::ReplaceInstance`] if either delete fails (one already gone is no error).
pub async fn replace(client: &Client, ns: &str, lost: &Unscheduled) -> Result<(), Error> {
    let failed = |source| Error::ReplaceInstance {
        pod: lost.pod.clone(),
        source,
    };
    let only = |uid: Option<String>| DeleteParams {
        preconditions: Some(Preconditions {
            uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let claim = format!("{DATA_VOLUME}-{}", lost.pod);
    unless_gone(claims.delete(&claim, &only(lost.claim_uid.clone())).await).map_err(failed)?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    unless_gone(pods.delete(&lost.pod, &only(lost.pod_uid.clone())).await)
        .map(drop)
        .map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ordinal: i32, ready: bool) -> PodView {
        PodView::named(name, ordinal, ready)
    }

    fn gone(pod: &str, node: &str) -> Unscheduled {
        Unscheduled {
            pod: pod.into(),
            volume: Volume::OnGoneNodes(BTreeSet::from([node.to_string()])),
            claim_uid: None,
            pod_uid: None,
        }
    }

    #[test]
    fn a_replica_whose_volume_is_gone_is_replaced_only_while_a_primary_runs() {
        let pods = [
            pod("pg-0", 0, false),
            pod("pg-1", 1, true),
            pod("pg-2", 2, true),
        ];
        let lost = [gone("pg-0", "a")];
        assert!(matches!(
            decide(Some("pg-1"), &pods, &lost),
            Decision::Replace { pod, .. } if pod == "pg-0"
        ));
        // No primary (an election under way), or the primary not ready: kept.
        assert!(matches!(
            decide(None, &pods, &lost),
            Decision::Blocked { .. }
        ));
        let down = [pod("pg-0", 0, false), pod("pg-1", 1, false)];
        assert!(matches!(
            decide(Some("pg-1"), &down, &lost),
            Decision::Blocked { .. }
        ));
        // The primary's own volume: a failover first.
        assert!(matches!(
            decide(Some("pg-0"), &pods, &lost),
            Decision::Blocked { why, .. } if why.contains("Lease")
        ));
    }

    #[test]
    fn a_pod_whose_claim_is_gone_is_replaced_too() {
        let pods = [pod("pg-0", 0, true), pod("pg-1", 1, false)];
        let gone = [Unscheduled {
            pod: "pg-1".into(),
            volume: Volume::ClaimGone("data-pg-1".into()),
            claim_uid: None,
            pod_uid: None,
        }];
        assert!(matches!(
            decide(Some("pg-0"), &pods, &gone),
            Decision::Replace { pod, why } if pod == "pg-1" && why.contains("claim data-pg-1 is gone")
        ));
    }

    #[test]
    fn present_volumes_are_left_and_the_lowest_ordinal_goes_first() {
        let pods = [
            pod("pg-0", 0, true),
            pod("pg-1", 1, false),
            pod("pg-2", 2, false),
        ];
        let present = [Unscheduled {
            pod: "pg-1".into(),
            volume: Volume::Present,
            claim_uid: None,
            pod_uid: None,
        }];
        assert_eq!(decide(Some("pg-0"), &pods, &present), Decision::Nothing);
        let two = [
            Unscheduled {
                pod: "pg-2".into(),
                volume: Volume::Gone("pv-2".into()),
                claim_uid: None,
                pod_uid: None,
            },
            gone("pg-1", "b"),
        ];
        assert!(matches!(
            decide(Some("pg-0"), &pods, &two),
            Decision::Replace { pod, .. } if pod == "pg-1"
        ));
    }
}
