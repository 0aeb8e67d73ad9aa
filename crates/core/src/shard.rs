//! Sharding: one controller's objects spread over several replicas, on Leases and labels.
//!
//! With `--shards N` (N > 1, leader election on) every object of a sharded controller belongs
//! to one of N shards, and each replica reconciles, watches and caches only the shards it holds:
//!
//! ```text
//! shard_of(key)        stable hash of the object's namespace/name, mod N     (pure)
//! SHARD_LABEL          written on the object by the labeller (the main leader), and on
//!                      every child by steward-core's Children (copied from the owner)
//! member Lease         one per replica ({lease}-member-…, labelled with the ring), renewed
//!                      every retry period: who is alive, seen on each replica's own clock
//! assign_keeping(N,    which live replica each shard should go to: its current holder
//!   members, holders)  where the balance allows, the rest by rendezvous hashing with
//!                      bounded loads (each replica gets ⌊N/M⌋ or ⌈N/M⌉ shards)     (pure)
//! shard Lease          one per shard ({lease}-shard-i), an ordinary leader election whose
//!                      candidacy is "the assignment names me"; a holder the assignment no
//!                      longer names releases it
//! ```
//!
//! A shard's controller (its watches with `SHARD_LABEL=i` added to their selectors, its
//! stores, its queue) runs only while this replica holds the shard's Lease, with a client
//! whose writes that Lease guards ([`crate::guard`]). Start with
//! [`crate::Operator::sharded_controller`].
//!
//! # Guarantees
//! - **One writer per shard.** The assignment only says who *tries*; who writes is decided
//!   by the shard's Lease alone, with every guarantee of [`crate::leader`]: a replica writes
//!   for a shard's objects only through that shard's guarded client, so no two replicas
//!   reconcile an object at once even while their views of the ring differ.
//! - **Takeover.** When a replica dies its member Lease stops changing; after
//!   `lease_duration` on the others' clocks it is no longer live, the assignment moves its
//!   shards, and their new holders take them at their next retry: the shard Lease has been
//!   unchanged just as long. So a dead replica's shards are taken over within about
//!   `lease_duration + retry_period`, while the other shards keep their holders and work.
//! - **Balance and little movement.** Each live replica is assigned ⌊N/M⌋ or ⌈N/M⌉ shards; a
//!   replica leaving moves only its own shards, one joining takes about N/M from the others
//!   (current holders keep their shards where the balance allows; the rest by rendezvous
//!   hashing). (Before the holders counted, bounded loads computed from scratch could move a
//!   live replica's shard when another died: found on three real nodes.)
//!   A shard is handed over by release, so a joining replica takes it within a watch event.
//! - **A single replica works unchanged**: with `--shards 1` (the default) none of this runs.
//!
//! # Caveats
//! - A handed-over or taken-over shard is listed again by its new holder before its first
//!   reconcile (its cache is per holder): failover includes one list of that shard.
//! - An object without the label (just created) is reconciled once the labeller, which runs
//!   on the main leader, has labelled it: one extra write and watch event per new object.
//!   Children a user creates (a namespace an owner makes) are labelled by it the same way.
//! - Cluster-wide reads a reconcile does through its stores see only its shard; reads that
//!   must see every object (a conflict between two owners) have to go to the API server.
//! - Changing N moves most objects to other shards: every object is labelled again. Two
//!   deployments of one operator that split objects by a label selector must use the same N:
//!   the label is computed from the object (or its owner's) key alone, and a children labeller
//!   (the tenant-operator's, for namespaces owners create) sees every owner's children.

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use sha2::Digest;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::leader::LeaseConfig;
pub use crate::object::SHARD_LABEL;
use crate::object::ScopeApi;

/// Gives the key an object is sharded by, from its metadata (`None`: not a sharded object).
pub type ShardKey = Arc<dyn Fn(&ObjectMeta) -> Option<String> + Send + Sync>;

/// The label naming the ring a member Lease belongs to.
pub const RING_LABEL: &str = "steward.dev/ring";

/// A stable 64-bit hash (the first 8 bytes of SHA-256): the same on every replica and release.
fn hash(parts: &[&str]) -> u64 {
    let mut h = sha2::Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_be_bytes(b)
}

/// The shard of the object `key` (`namespace/name`, or `name` when cluster-scoped).
pub fn shard_of(key: &str, shards: u32) -> u32 {
    // The remainder is below `shards`, so it fits.
    u32::try_from(hash(&[key]) % u64::from(shards.max(1))).unwrap_or(0)
}

/// The key [`shard_of`] hashes for an object.
pub fn key_of(meta: &ObjectMeta) -> String {
    let name = meta.name.clone().unwrap_or_default();
    match &meta.namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name,
    }
}

/// The label selector of shard `shard`'s objects.
pub fn selector(shard: u32) -> String {
    format!("{SHARD_LABEL}={shard}")
}

/// `base` (a label selector, possibly empty) narrowed to shard `shard` when there is one.
pub fn narrow(base: Option<&str>, shard: Option<u32>) -> Option<String> {
    match (base.filter(|b| !b.trim().is_empty()), shard) {
        (Some(b), Some(s)) => Some(format!("{b},{}", selector(s))),
        (Some(b), None) => Some(b.to_string()),
        (None, Some(s)) => Some(selector(s)),
        (None, None) => None,
    }
}

/// Which of `members` each of `shards` shards goes to, from scratch: [`assign_keeping`] with
/// no current holders.
pub fn assign(shards: u32, members: &[String]) -> Vec<Option<String>> {
    assign_keeping(shards, members, &[])
}

/// Which of `members` each of `shards` shards goes to, keeping shards with their current
/// holders (`holders[i]`: shard `i`'s, if any) where the balance allows. Each member gets
/// `q = ⌊shards/members⌋` or `q + 1`, exactly `shards mod members` of them `q + 1`:
/// 1. a shard stays with its holder if the holder is a member with fewer than `q`;
/// 2. then with its holder if that holder has `q` and members with `q + 1` are still allowed;
/// 3. every other shard, in order, goes to the member with the highest score
///    `hash(member, shard)` among those below `q`, else among those at `q` while `q + 1` is
///    still allowed (rendezvous hashing with bounded loads).
///
/// So a member leaving moves only its own shards, and one joining takes about `shards/members`
/// of them from the others; with no holders (a fresh ring) it is plain rendezvous hashing
/// with bounded loads. `None` for every shard when there are no members. Pure and the same on
/// every replica for the same members and holders.
pub fn assign_keeping(
    shards: u32,
    members: &[String],
    holders: &[Option<String>],
) -> Vec<Option<String>> {
    let mut members: Vec<&String> = members.iter().collect();
    members.sort();
    members.dedup();
    if members.is_empty() {
        return vec![None; shards as usize];
    }
    let n = shards as usize;
    let (q, mut extra) = (n / members.len(), n % members.len());
    let mut load: HashMap<&str, usize> = HashMap::new();
    let mut plan: Vec<Option<String>> = vec![None; n];
    let member = |h: &Option<String>| {
        h.as_deref()
            .and_then(|h| members.iter().find(|m| m.as_str() == h).copied())
    };
    // 1 and 2: current holders keep what the balance allows.
    for pass in [false, true] {
        for (shard, slot) in plan.iter_mut().enumerate() {
            let Some(holder) = holders.get(shard).and_then(&member) else {
                continue;
            };
            if slot.is_some() {
                continue;
            }
            let l = load.entry(holder.as_str()).or_default();
            if *l < q || (pass && *l == q && extra > 0) {
                if *l == q {
                    extra -= 1;
                }
                *l += 1;
                *slot = Some(holder.clone());
            }
        }
    }
    // 3: the rest by rendezvous hashing, below q first, then up to q + 1 while allowed.
    for (shard, slot) in plan.iter_mut().enumerate() {
        if slot.is_some() {
            continue;
        }
        let key = shard.to_string();
        let best = |allowed: &dyn Fn(usize) -> bool| {
            members
                .iter()
                .filter(|m| allowed(load.get(m.as_str()).copied().unwrap_or(0)))
                .max_by_key(|m| (hash(&[m.as_str(), &key]), m.as_str()))
                .copied()
        };
        let chosen = best(&|l| l < q).or_else(|| (extra > 0).then(|| best(&|l| l == q)).flatten());
        if let Some(m) = chosen {
            let l = load.entry(m.as_str()).or_default();
            if *l == q {
                extra -= 1;
            }
            *l += 1;
            *slot = Some(m.clone());
        }
    }
    plan
}

/// This replica's view of the ring: the candidacy of each shard, from live member Leases.
pub(crate) struct Ring {
    client: Client,
    config: LeaseConfig,
    ring: String,
    shards: u32,
    candidacy: Vec<watch::Sender<bool>>,
    /// Flips to `true` after the first full pass (members read, candidacy published).
    settled: watch::Sender<bool>,
}

impl Ring {
    /// The ring `ring` (the operator's Lease name) of `shards` shards, for the candidate of
    /// `config` (its identity, namespace and timings; its lease name is not used).
    pub(crate) fn new(client: Client, config: LeaseConfig, ring: &str, shards: u32) -> Self {
        Self {
            client,
            config,
            ring: ring.to_string(),
            shards,
            candidacy: (0..shards).map(|_| watch::channel(false).0).collect(),
            settled: watch::channel(false).0,
        }
    }

    /// The candidacy gate of shard `shard` (see [`crate::LeaderElector::with_candidacy`]).
    pub(crate) fn candidacy(&self, shard: u32) -> watch::Receiver<bool> {
        self.candidacy[shard as usize].subscribe()
    }

    /// `true` once the ring has read the members once.
    pub(crate) fn settled(&self) -> watch::Receiver<bool> {
        self.settled.subscribe()
    }

    /// The name of this replica's member Lease.
    fn member_lease(&self) -> String {
        format!(
            "{}-member-{:016x}",
            self.ring,
            hash(&[&self.config.identity])
        )
    }

    /// Renews this replica's member Lease and recomputes the assignment every retry period
    /// until `shutdown`; then deletes the member Lease, so the others rebalance at once.
    pub(crate) async fn run(self, shutdown: CancellationToken) {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let mine = self.member_lease();
        let mut seen: HashMap<String, (String, Instant)> = HashMap::new();
        loop {
            if let Err(e) = self.renew(&api, &mine).await {
                tracing::warn!(lease = %mine, error = %e, "failed to renew the ring member lease");
            }
            // The namespace's Leases: the ring's members (labelled) and its shards' (by name),
            // whose holders keep their shards where the balance allows (see `assign_keeping`).
            match api.list(&ListParams::default()).await {
                Ok(list) => {
                    let now = Instant::now();
                    let mut live = vec![self.config.identity.clone()];
                    let mut present = std::collections::HashSet::new();
                    let (members, others): (Vec<Lease>, Vec<Lease>) =
                        list.items.into_iter().partition(|l| {
                            l.labels().get(RING_LABEL).map(String::as_str) == Some(&self.ring)
                        });
                    let holders = self.holders(&others);
                    for lease in members {
                        let name = lease.name_any();
                        present.insert(name.clone());
                        let Some(spec) = lease.spec else { continue };
                        let Some(holder) = spec.holder_identity.clone() else {
                            continue;
                        };
                        let version = format!("{:?}", spec.renew_time);
                        let since = match seen.get(&name) {
                            Some((v, since)) if *v == version => *since,
                            _ => now,
                        };
                        seen.insert(name, (version, since));
                        if now.duration_since(since) < self.config.lease_duration
                            && holder != self.config.identity
                        {
                            live.push(holder);
                        }
                    }
                    seen.retain(|name, _| present.contains(name));
                    let plan = assign_keeping(self.shards, &live, &holders);
                    for (shard, owner) in plan.iter().enumerate() {
                        let me = owner.as_deref() == Some(self.config.identity.as_str());
                        self.candidacy[shard].send_if_modified(|c| std::mem::replace(c, me) != me);
                    }
                    self.settled
                        .send_if_modified(|s| !std::mem::replace(s, true));
                }
                Err(e) => {
                    tracing::warn!(ring = %self.ring, error = %e, "failed to list the ring's member leases")
                }
            }
            // Look again at the next retry, or as soon as a live member would expire, so a
            // dead replica's shards move the moment it is past its lease duration.
            let now = Instant::now();
            let expiry = seen
                .values()
                .filter_map(|(_, since)| {
                    (*since + self.config.lease_duration).checked_duration_since(now)
                })
                .filter(|d| !d.is_zero())
                .min();
            let pause = expiry.map_or(self.config.retry_period, |e| {
                self.config
                    .retry_period
                    .min(e + std::time::Duration::from_millis(10))
            });
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        for c in &self.candidacy {
            c.send_if_modified(|c| std::mem::replace(c, false));
        }
        if let Err(e) = api.delete(&mine, &DeleteParams::default()).await {
            tracing::debug!(lease = %mine, error = %e, "failed to delete the ring member lease");
        }
    }

    /// Each shard's holder, from the shard Leases among `leases` (`<ring>-shard-<i>`; a
    /// released Lease holds nothing).
    fn holders(&self, leases: &[Lease]) -> Vec<Option<String>> {
        (0..self.shards)
            .map(|i| {
                let name = format!("{}-shard-{i}", self.ring);
                leases
                    .iter()
                    .find(|l| l.metadata.name.as_deref() == Some(name.as_str()))
                    .and_then(|l| l.spec.as_ref()?.holder_identity.clone())
                    .filter(|h| !h.is_empty())
            })
            .collect()
    }

    /// Creates or renews this replica's member Lease (holder: this identity; renewTime: now).
    async fn renew(&self, api: &Api<Lease>, name: &str) -> Result<(), kube::Error> {
        let spec = LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: i32::try_from(self.config.lease_duration.as_secs().max(1)).ok(),
            renew_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
            ..LeaseSpec::default()
        };
        let patch = serde_json::json!({"spec": {"holderIdentity": spec.holder_identity, "leaseDurationSeconds": spec.lease_duration_seconds, "renewTime": spec.renew_time}});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.to_string()),
                        labels: Some([(RING_LABEL.to_string(), self.ring.clone())].into()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(spec),
                };
                api.create(&PostParams::default(), &lease).await.map(|_| ())
            }
            other => other.map(|_| ()),
        }
    }
}

/// Keeps [`SHARD_LABEL`] on every `K` (of `api`'s scope) right: an object without it, or with
/// another shard's number, is patched to `shard_of(key(meta))`. Runs until `stop`; meant for
/// the main leader ([`crate::Operator::shard_labels`]); `namespace` limits it as `--watch-namespace` does. `key` gives the key an object is
/// sharded by: its own ([`key_of`]) for the sharded kind, its owner's for a child found by a
/// label (`None`: not ours, left alone).
pub async fn label<K>(
    client: Client,
    namespace: Option<String>,
    labels: Option<String>,
    shards: u32,
    key: ShardKey,
    stop: CancellationToken,
) where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::Scope: ScopeApi,
{
    let api: Api<K> = <K::Scope as ScopeApi>::api(client.clone(), namespace.as_deref());
    let mut config = watcher::Config::default().any_semantic();
    if let Some(l) = labels {
        config = config.labels(&l);
    }
    #[allow(deprecated)]
    let events = kube::runtime::metadata_watcher(api.clone(), config)
        .default_backoff()
        .take_until(stop.cancelled_owned());
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        let obj: PartialObjectMeta<K> = match event {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(error = %e, "shard labeller watch error");
                continue;
            }
        };
        let Some(k) = key(&obj.metadata) else {
            continue;
        };
        relabel::<K>(&client, &obj.metadata, &k, shards).await;
    }
}

/// Sets the [`SHARD_LABEL`] of the `K` whose metadata is `meta` to the shard of `key` (of
/// `shards`), unless it carries that already. A failure is logged and left for the object's
/// next event (the labeller sees it again).
pub async fn relabel<K>(client: &Client, meta: &ObjectMeta, key: &str, shards: u32)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    K::Scope: ScopeApi,
{
    let want = shard_of(key, shards).to_string();
    if meta.labels.as_ref().and_then(|l| l.get(SHARD_LABEL)) == Some(&want) {
        return;
    }
    let api: Api<K> = <K::Scope as ScopeApi>::api(client.clone(), meta.namespace.as_deref());
    let patch = serde_json::json!({"metadata": {"labels": {SHARD_LABEL: want}}});
    let name = meta.name.as_deref().unwrap_or_default();
    if let Err(e) = api
        .patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::debug!(object = %key, error = %e, "failed to label the object's shard");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("replica-{i}")).collect()
    }

    #[test]
    fn the_shard_of_a_key_is_stable_and_spread() {
        // One replica writes the shard label, others read it, across releases: the values
        // are pinned (computed apart from this code: the first 8 bytes of SHA-256 of the
        // key and a NUL, big-endian, modulo the shard count).
        assert_eq!(hash(&["ns/a"]), 0x1620_6c21_1bfe_9bd3);
        for (key, shards, want) in [
            ("ns/a", 3, 2),
            ("ns/b", 3, 2),
            ("payments", 3, 2),
            ("tenant-0", 4, 3),
            ("tenant-1", 4, 2),
            ("team-a/app", 16, 8),
        ] {
            assert_eq!(shard_of(key, shards), want, "shard of {key} among {shards}");
        }
        let mut counts = [0u32; 4];
        for i in 0..4000 {
            counts[shard_of(&format!("tenant-{i}"), 4) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
        assert_eq!(shard_of("x", 1), 0);
        assert_eq!(shard_of("x", 0), 0, "no shards count as one");
    }

    #[test]
    fn every_live_member_gets_its_fair_share() {
        for (shards, n) in [(3, 3), (3, 2), (8, 3), (2, 5), (12, 4)] {
            let plan = assign(shards, &members(n));
            assert!(plan.iter().all(Option::is_some));
            let mut load: HashMap<String, usize> = HashMap::new();
            for m in plan.into_iter().flatten() {
                *load.entry(m).or_default() += 1;
            }
            let (lo, hi) = (shards as usize / n, (shards as usize).div_ceil(n));
            assert!(
                load.values().all(|l| (lo..=hi).contains(l)),
                "{shards} shards over {n}: {load:?}"
            );
        }
        assert_eq!(assign(2, &[]), vec![None, None]);
    }

    #[test]
    fn the_assignment_ignores_order_and_duplicates() {
        let mut m = members(3);
        let a = assign(6, &m);
        m.reverse();
        m.push("replica-1".into());
        assert_eq!(assign(6, &m), a);
    }

    #[test]
    fn a_member_leaving_moves_only_its_shards() {
        for (shards, n) in [(3, 3), (64, 4), (8, 3), (5, 2)] {
            let m = members(n);
            let before = assign(shards, &m);
            for gone in &m {
                let rest: Vec<String> = m.iter().filter(|x| *x != gone).cloned().collect();
                let after = assign_keeping(shards, &rest, &before);
                for (i, (b, a)) in before.iter().zip(&after).enumerate() {
                    if b.as_ref() != Some(gone) {
                        assert_eq!(a, b, "shard {i} of {shards} moved when {gone} left {n}");
                    }
                }
                assert!(
                    after
                        .iter()
                        .all(|a| a.is_some() && a.as_ref() != Some(gone))
                );
                fair(&after, shards, n - 1);
            }
        }
    }

    #[test]
    fn a_member_joining_takes_its_share_and_nothing_else_moves() {
        for (shards, n) in [(3, 2), (64, 3), (8, 3), (2, 2)] {
            let m = members(n);
            let before = assign(shards, &m);
            let mut more = m.clone();
            more.push("replica-new".into());
            let after = assign_keeping(shards, &more, &before);
            let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
            let taken = after
                .iter()
                .filter(|a| a.as_deref() == Some("replica-new"))
                .count();
            assert_eq!(moved, taken, "only shards the newcomer takes move");
            fair(&after, shards, n + 1);
        }
    }

    #[test]
    fn holders_that_left_or_exceed_their_share_are_not_kept() {
        let m = members(2);
        // A holder that is no member, and one holding every shard.
        let stale = vec![
            Some("gone".to_string()),
            Some("replica-0".into()),
            Some("replica-0".into()),
            Some("replica-0".into()),
        ];
        let plan = assign_keeping(4, &m, &stale);
        fair(&plan, 4, 2);
        assert!(plan.iter().all(|p| p.as_deref() != Some("gone")));
    }

    /// Each member gets ⌊shards/n⌋ or ⌈shards/n⌉ shards, every shard a member.
    fn fair(plan: &[Option<String>], shards: u32, n: usize) {
        assert!(plan.iter().all(Option::is_some), "{plan:?}");
        let mut load: HashMap<&str, usize> = HashMap::new();
        for m in plan.iter().flatten() {
            *load.entry(m.as_str()).or_default() += 1;
        }
        let (lo, hi) = (shards as usize / n, (shards as usize).div_ceil(n));
        assert!(
            load.values().all(|l| (lo..=hi).contains(l)) && (lo == 0 || load.len() == n),
            "{shards} shards over {n}: {load:?}"
        );
    }

    #[test]
    fn selectors_narrow_to_the_shard() {
        assert_eq!(
            narrow(Some("a=b"), Some(2)).as_deref(),
            Some("a=b,steward.dev/shard=2")
        );
        assert_eq!(
            narrow(None, Some(0)).as_deref(),
            Some("steward.dev/shard=0")
        );
        assert_eq!(narrow(Some(" "), None), None);
        assert_eq!(narrow(Some("a"), None).as_deref(), Some("a"));
    }
}
