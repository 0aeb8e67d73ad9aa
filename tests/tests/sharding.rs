//! Sharding (`--shards`, `steward_core::shard`) against the real control plane: replicas in
//! this process, each on its own Tokio runtime, so that "killing" one (dropping its runtime
//! without a graceful shutdown) leaves its Leases unreleased, as a SIGKILL would.
//!
//! - `sharded_objects_have_one_writer_and_a_dead_replicas_shard_is_taken_over`: a sharded
//!   controller of ConfigMaps whose every reconcile writes; after each write that the API
//!   server accepted, the test checks that no other replica held that shard at that instant.
//! - `tenants_spread_over_three_replicas`: the tenant-operator with `--shards 3`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use kube::{Client, CustomResourceExt, ResourceExt};
use steward_core::cli::CommonArgs;
use steward_core::shard::{SHARD_LABEL, key_of, narrow};
use steward_core::{Context, Controller, Leadership, Operator};
use steward_testenv::{ControlPlane, eventually};

#[path = "support/fixtures.rs"]
mod fixtures;

const TEST_LABEL: &str = "steward.dev/test";
const SHARDS: u32 = 3;
const LEASE_DURATION: Duration = Duration::from_secs(3);
const RENEW_DEADLINE: Duration = Duration::from_secs(2);
const RETRY_PERIOD: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(90);

fn suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:05x}", h.finish() & 0xfffff)
}

/// A value that changes at every write, so every write is a real change.
static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn args(namespace: &str, lease: &str) -> CommonArgs {
    CommonArgs {
        leader_elect: true,
        leader_election_namespace: Some(namespace.to_string()),
        leader_election_id: Some(lease.to_string()),
        leader_election_lease_duration: LEASE_DURATION,
        leader_election_renew_deadline: RENEW_DEADLINE,
        leader_election_retry_period: RETRY_PERIOD,
        shards: SHARDS,
        metrics_bind_address: "0".into(),
        health_probe_bind_address: "0".into(),
        shutdown_timeout: Duration::from_secs(5),
        ..CommonArgs::default()
    }
}

/// One replica on a runtime of its own: dropping it (or [`Replica::kill`]) drops every task,
/// Lease renewals included, without releasing anything.
struct Replica {
    runtime: Option<tokio::runtime::Runtime>,
    identity: String,
    shards: Vec<Leadership>,
    metrics: steward_core::metrics::Metrics,
}

impl Replica {
    /// Builds an operator with `configure` on a new runtime and runs it there.
    async fn start(
        cp: &ControlPlane,
        args: CommonArgs,
        configure: impl FnOnce(&mut Operator) + Send + 'static,
    ) -> Replica {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let config = cp.config().clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        runtime.spawn(async move {
            let mut operator =
                Operator::with_config("sharding-test", args, config).expect("operator");
            configure(&mut operator);
            let _ = tx.send((
                operator.leadership().identity().to_string(),
                operator.shard_leaderships(),
                operator.metrics(),
            ));
            let _ = operator.run().await;
        });
        let (identity, shards, metrics) = rx.await.expect("replica started");
        Replica {
            runtime: Some(runtime),
            identity,
            shards,
            metrics,
        }
    }

    fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Which replica each shard's Lease names, by shard (`None`: unheld or missing).
async fn holders(client: &Client, ns: &str, lease: &str) -> Vec<Option<String>> {
    let api: Api<Lease> = Api::namespaced(client.clone(), ns);
    let mut out = Vec::new();
    for shard in 0..SHARDS {
        let holder = api
            .get_opt(&format!("{lease}-shard-{shard}"))
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty());
        out.push(holder);
    }
    out
}

async fn namespace(client: &Client, name: &str) {
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &fixtures::namespace(name))
        .await
        .expect("namespace");
}

#[derive(Debug, thiserror::Error)]
#[error("write failed: {0}")]
struct WriteFailed(#[source] kube::Error);

impl steward_core::ReconcileError for WriteFailed {}

/// A replica's identity and its leadership of each shard.
type Holds = (String, Vec<Leadership>);

/// What every replica's reconciles share: every replica's shard leaderships, and what went
/// wrong.
#[derive(Clone, Default)]
struct Witness {
    replicas: Arc<Mutex<Vec<Holds>>>,
    /// Writes accepted while another replica held the shard.
    overlaps: Arc<Mutex<Vec<String>>>,
    /// Accepted writes per (object, writer).
    writes: Arc<Mutex<BTreeMap<(String, String), u64>>>,
}

struct Probe {
    me: String,
    witness: Witness,
}

/// Writes the object (an annotation naming this replica and a counter), then checks that no
/// other replica held the object's shard when the write was answered.
async fn reconcile(cm: Arc<ConfigMap>, ctx: Arc<Context<Probe>>) -> Result<Action, WriteFailed> {
    let Some(shard) = cm
        .labels()
        .get(SHARD_LABEL)
        .and_then(|s| s.parse::<usize>().ok())
    else {
        return Ok(Action::await_change());
    };
    let api: Api<ConfigMap> =
        Api::namespaced(ctx.client.clone(), &cm.namespace().unwrap_or_default());
    let patch = serde_json::json!({"metadata": {"annotations": {"test.steward.dev/writer": ctx.data.me}}, "data": {"n": WRITES.fetch_add(1, std::sync::atomic::Ordering::SeqCst).to_string()}});
    api.patch(
        &cm.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map_err(WriteFailed)?;
    let witness = &ctx.data.witness;
    for (other, shards) in witness.replicas.lock().expect("witness").iter() {
        if *other != ctx.data.me && shards.get(shard).is_some_and(Leadership::is_leader) {
            witness.overlaps.lock().expect("witness").push(format!(
                "{} written by {} while {other} held shard {shard}",
                cm.name_any(),
                ctx.data.me
            ));
        }
    }
    *witness
        .writes
        .lock()
        .expect("witness")
        .entry((cm.name_any(), ctx.data.me.clone()))
        .or_default() += 1;
    Ok(Action::requeue(Duration::from_millis(700)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_objects_have_one_writer_and_a_dead_replicas_shard_is_taken_over() {
    let cp = steward_testenv::shared().await.expect("control plane");
    let client = cp.client().expect("client");
    let id = format!("shard-{}", suffix());
    namespace(&client, &id).await;
    let selector = format!("{TEST_LABEL}={id}");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &id);
    for i in 0..12 {
        let cm = ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(format!("cm-{i}")),
                labels: Some([(TEST_LABEL.to_string(), id.clone())].into()),
                ..Default::default()
            },
            ..Default::default()
        };
        cms.create(&PostParams::default(), &cm).await.expect("cm");
    }

    let listed = || async {
        cms.list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| e.to_string())
    };
    let witness = Witness::default();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let (ns, selector, witness_r) = (id.clone(), selector.clone(), witness.clone());
        let labelled = selector.clone();
        let replica = Replica::start(cp, args(&id, &id), move |op| {
            let client = op.unguarded_client();
            let me = op.leadership().identity().to_string();
            op.sharded_controller(
                move |shard| {
                    let config = watcher::Config::default()
                        .labels(&narrow(Some(&selector), shard).unwrap_or_default());
                    let controller =
                        Controller::new(Api::<ConfigMap>::namespaced(client.clone(), &ns), config);
                    let probe = Probe {
                        me: me.clone(),
                        witness: witness_r.clone(),
                    };
                    (controller, probe)
                },
                reconcile,
            );
            op.shard_labels::<ConfigMap>(Some(&labelled), |m| Some(key_of(m)));
        })
        .await;
        witness
            .replicas
            .lock()
            .unwrap()
            .push((replica.identity.clone(), replica.shards.clone()));
        replicas.push(replica);
    }

    // Every shard held, one each (3 shards over 3 replicas), every object labelled and written.
    eventually("each replica holds one shard", WAIT, || async {
        let h = holders(&client, &id, &id).await;
        let distinct: BTreeSet<_> = h.iter().flatten().collect();
        if h.iter().all(Option::is_some) && distinct.len() == 3 {
            Ok(h)
        } else {
            Err(format!("shard holders {h:?}"))
        }
    })
    .await
    .expect("each replica holds one shard");
    eventually("every object labelled and written", WAIT, || async {
        let list = listed().await?;
        list.items
            .iter()
            .all(|cm| {
                cm.labels().get(SHARD_LABEL)
                    == Some(
                        &steward_core::shard::shard_of(&key_of(&cm.metadata), SHARDS).to_string(),
                    )
                    && cm.annotations().contains_key("test.steward.dev/writer")
            })
            .then_some(())
            .ok_or_else(|| "not every object labelled and written yet".to_string())
    })
    .await
    .expect("every object labelled with its shard and written");
    // Each object written by the holder of its shard. Its last write may still be the previous
    // holder's right after a hand-over (the first replica held every shard until the others
    // joined), so this waits for the current holders' writes.
    let by_shard =
        |cm: &ConfigMap| -> usize { cm.labels()[SHARD_LABEL].parse().expect("shard number") };
    let spread = eventually(
        "each object written by its shard's holder",
        WAIT,
        || async {
            let h = holders(&client, &id, &id).await;
            let list = listed().await?;
            let stray: Vec<String> = list
                .items
                .iter()
                .filter(|cm| {
                    cm.annotations().get("test.steward.dev/writer") != h[by_shard(cm)].as_ref()
                })
                .map(ResourceExt::name_any)
                .collect();
            if stray.is_empty() && h.iter().all(Option::is_some) {
                Ok(h)
            } else {
                Err(format!("holders {h:?}; last written by another: {stray:?}"))
            }
        },
    )
    .await
    .expect("each object written by its shard's holder");
    let list = cms
        .list(&ListParams::default().labels(&selector))
        .await
        .expect("list");

    // Kill the holder of shard 0: its Leases stay held until they expire.
    let victim = spread[0].clone().expect("held");
    let other_shards: Vec<String> = list
        .items
        .iter()
        .filter(|cm| by_shard(cm) != 0)
        .map(ResourceExt::name_any)
        .collect();
    let writes_of = |names: &[String]| -> u64 {
        witness
            .writes
            .lock()
            .unwrap()
            .iter()
            .filter(|((n, _), _)| names.contains(n))
            .map(|(_, c)| c)
            .sum()
    };
    let before = writes_of(&other_shards);
    let killed = Instant::now();
    replicas
        .iter_mut()
        .find(|r| r.identity == victim)
        .expect("victim")
        .kill();
    let new_holder = eventually("shard 0 taken over", WAIT, || async {
        let h = holders(&client, &id, &id).await;
        h[0].clone()
            .filter(|holder| *holder != victim)
            .ok_or_else(|| format!("shard 0 held by {:?}", h[0]))
    })
    .await
    .expect("shard 0 taken over");
    let takeover = killed.elapsed();
    let during = writes_of(&other_shards) - before;
    eprintln!(
        "shard 0 taken over by {new_holder} {takeover:?} after its holder was killed (lease duration {LEASE_DURATION:?}, retry period {RETRY_PERIOD:?}); {during} writes to the other shards meanwhile"
    );
    assert!(
        during > 0,
        "the other shards kept being reconciled while shard 0 had no holder"
    );
    // Bound: lease duration (member and shard Leases expire together) + a retry period, with
    // room for a loaded 2-core machine.
    assert!(
        takeover < LEASE_DURATION + RETRY_PERIOD * 2 + Duration::from_secs(4),
        "takeover took {takeover:?}"
    );
    // The dead replica's objects are written by their new holder.
    let shard0: Vec<String> = list
        .items
        .iter()
        .filter(|cm| by_shard(cm) == 0)
        .map(ResourceExt::name_any)
        .collect();
    eventually("shard 0 written by its new holder", WAIT, || async {
        let list = listed().await?;
        list.items
            .iter()
            .filter(|cm| shard0.contains(&cm.name_any()))
            .all(|cm| cm.annotations().get("test.steward.dev/writer") == Some(&new_holder))
            .then_some(())
            .ok_or_else(|| "not yet".to_string())
    })
    .await
    .expect("shard 0's objects written by the new holder");
    let overlaps = witness.overlaps.lock().expect("witness").clone();
    assert!(overlaps.is_empty(), "two writers at once: {overlaps:?}");
    drop(replicas);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_spread_over_three_replicas() {
    use tenant_operator::crd::{TENANT_LABEL, Tenant};
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.apply_crd(&Tenant::crd()).await.expect("Tenant CRD");
    let client = cp.client().expect("client");
    let id = format!("tshard-{}", suffix());
    namespace(&client, &id).await;
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let selector = format!("{TEST_LABEL}={id}");
        replicas.push(
            Replica::start(cp, args(&id, &id), move |op| {
                let options = tenant_operator::Options {
                    tenant_selector: Some(selector),
                    apply_policies: false,
                    ..tenant_operator::Options::default()
                };
                tenant_operator::register(op, options).expect("register");
            })
            .await,
        );
    }
    let tenants: Api<Tenant> = Api::all(client.clone());
    let names: Vec<String> = (0..6).map(|i| format!("{id}-t{i}")).collect();
    for name in &names {
        let t = fixtures::tenant(name)
            .label(TEST_LABEL, &id)
            .owner_user("alice")
            .namespaces([format!("{name}-a")])
            .build();
        tenants
            .create(&PostParams::default(), &t)
            .await
            .expect("create");
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for name in &names {
        let shard = steward_core::shard::shard_of(name, SHARDS).to_string();
        eventually("tenant Ready in its shard", WAIT, || async {
            let t = tenants.get(name).await.map_err(|e| e.to_string())?;
            let ready = t.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
            (ready && t.labels().get(SHARD_LABEL) == Some(&shard))
                .then_some(())
                .ok_or_else(|| format!("{:?} {:?}", t.labels(), t.status))
        })
        .await
        .unwrap_or_else(|_| panic!("tenant {name} Ready and labelled shard {shard}"));
        let ns = namespaces
            .get(&format!("{name}-a"))
            .await
            .expect("its namespace");
        assert_eq!(ns.labels().get(TENANT_LABEL), Some(name));
        assert_eq!(
            ns.labels().get(SHARD_LABEL),
            Some(&shard),
            "a child carries its owner's shard"
        );
    }
    let h = holders(&client, &id, &id).await;
    let distinct: BTreeSet<_> = h.iter().flatten().collect();
    assert_eq!(distinct.len(), 3, "each replica holds one shard: {h:?}");
    // The per-Tenant gauges: each Tenant reported by exactly one replica, its shard's holder.
    eventually("each Tenant's gauge on one replica", WAIT, || async {
        let scraped: Vec<String> = replicas.iter().map(|r| r.metrics.encode()).collect();
        for name in &names {
            let series = format!("steward_tenant_ready{{tenant=\"{name}\"}}");
            let on: Vec<usize> = (0..scraped.len())
                .filter(|&i| scraped[i].lines().any(|l| l.starts_with(&series)))
                .collect();
            let shard = steward_core::shard::shard_of(name, SHARDS) as usize;
            let holder = replicas
                .iter()
                .position(|r| Some(&r.identity) == h[shard].as_ref());
            if on.len() != 1 || holder != on.first().copied() {
                return Err(format!("{name}: on replicas {on:?}, holder {holder:?}"));
            }
        }
        Ok(())
    })
    .await
    .expect("per-Tenant gauges follow the shards");
    for name in &names {
        tenants
            .delete(name, &Default::default())
            .await
            .expect("delete");
    }
    eventually("tenants deleted", WAIT, || async {
        let left = tenants
            .list(&ListParams::default().labels(&format!("{TEST_LABEL}={id}")))
            .await
            .map_err(|e| e.to_string())?;
        left.items
            .is_empty()
            .then_some(())
            .ok_or_else(|| format!("{} left", left.items.len()))
    })
    .await
    .expect("tenants deleted through their finalizers");
    drop(replicas);
}
