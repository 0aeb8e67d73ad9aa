//! Sharding (`--shards`, `steward_core::shard`) against the real control plane: replicas in
//! this process, each on its own Tokio runtime, so that "killing" one (dropping its runtime
//! without a graceful shutdown) leaves its Leases unreleased, as a SIGKILL would.
//!
//! - `sharded_objects_have_one_writer_and_a_dead_replicas_shard_is_taken_over`: a sharded
//!   controller of ConfigMaps whose every reconcile writes; after each write that the API
//!   server accepted, the test checks that no other replica held that shard at that instant.
//! - `tenants_spread_over_three_replicas`: the tenant-operator with `--shards 3`.
//! - `database_objects_shard_by_their_server`: the database-operator with `--shards 3`: a
//!   PostgresCluster's Databases and DatabaseRoles on its shard, an external server's on the
//!   server's, each written by that shard's holder only.

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
        Self::start_as(cp, "sharding-test", args, configure).await
    }

    /// [`Replica::start`] with the operator named `name` (its field manager and Event
    /// reporter).
    async fn start_as(
        cp: &ControlPlane,
        name: &'static str,
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
            let mut operator = Operator::with_config(name, args, config).expect("operator");
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

/// Who wrote about each object: the `reportingInstance` of every Event regarding it, with how
/// often each reported (an Event's `count`).
async fn reporters(client: &Client, ns: &str) -> BTreeMap<(String, String), BTreeMap<String, i32>> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), ns);
    let mut out: BTreeMap<(String, String), BTreeMap<String, i32>> = BTreeMap::new();
    for e in events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
    {
        let (Some(kind), Some(name)) = (e.involved_object.kind, e.involved_object.name) else {
            continue;
        };
        let instance = e.reporting_instance.unwrap_or_default();
        *out.entry((kind, name))
            .or_default()
            .entry(instance)
            .or_default() += e.count.unwrap_or(1);
    }
    out
}

/// The replicas (identities) whose sessions PostgreSQL logged (`application_name`
/// `database-operator <identity>`), with how many lines each.
fn sessions(log: &str) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for line in log.lines() {
        if let Some(rest) = line.split_once("[database-operator ").map(|(_, r)| r)
            && let Some((identity, _)) = rest.split_once(']')
        {
            *out.entry(identity.to_string()).or_default() += 1;
        }
    }
    out
}

/// The database-operator with `--shards 3` on three replicas: three PostgresClusters (one per
/// shard) with a Database each and a DatabaseRole on one of them, and two external servers
/// with a Database and a DatabaseRole each. Every Database and DatabaseRole is labelled with
/// its cluster's (or its server's) shard, as are their children; every object converges; and
/// everything written about an object comes from its shard's holder alone: the Events about
/// it (`reportingInstance`), the statements its server ran (`application_name`), its
/// cluster's gauges (like the tenants').
///
/// No pod runs here and this process cannot resolve a cluster's Service, so the Databases of
/// the clusters must not try to connect: the name of each one's credentials Secret (and the
/// DatabaseRole's) is taken by a Secret of the test's, which the operator refuses to touch
/// (`SecretConflict`) and retries, an Event each time, before any connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_objects_shard_by_their_server() {
    use database_operator::crd::{
        Database, DatabaseRole, DatabaseRoleSpec, DatabaseSpec, DeletionPolicy, ExternalServer,
        LocalRef, PostgresCluster, Privileges,
    };
    use database_operator::sharding::server_key;
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::core::v1::Secret;
    use steward_core::shard::shard_of;
    use steward_testenv::postgres::Postgres;

    let started = Instant::now();
    let cp = steward_testenv::shared().await.expect("control plane");
    for crd in database_operator::crds() {
        cp.apply_crd(&crd).await.expect("CRD");
    }
    let client = cp.client().expect("client");
    let id = format!("dbshard-{}", suffix());
    namespace(&client, &id).await;
    // The servers start while the replicas settle.
    let servers = tokio::spawn(async { futures::join!(Postgres::start(), Postgres::start()) });
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let args = CommonArgs {
            watch_namespace: Some(id.clone()),
            ..args(&id, &id)
        };
        replicas.push(
            Replica::start_as(cp, database_operator::NAME, args, |op| {
                let options = database_operator::Options {
                    resync_interval: Duration::from_secs(2),
                    check_parameters: false,
                    ..database_operator::Options::default()
                };
                database_operator::register(op, options).expect("register");
            })
            .await,
        );
    }
    let settled = eventually("each replica holds one shard", WAIT, || async {
        let h = holders(&client, &id, &id).await;
        let distinct: BTreeSet<_> = h.iter().flatten().collect();
        if h.iter().all(Option::is_some) && distinct.len() == 3 {
            Ok(h.into_iter().flatten().collect::<Vec<String>>())
        } else {
            Err(format!("shard holders {h:?}"))
        }
    })
    .await
    .expect("each replica holds one shard");
    let (a, b) = servers.await.expect("servers");
    let pgs = [a.expect("PostgreSQL"), b.expect("PostgreSQL")];
    eprintln!(
        "settled after {:?}: shard holders {settled:?}",
        started.elapsed()
    );

    let clusters: Api<PostgresCluster> = Api::namespaced(client.clone(), &id);
    let databases: Api<Database> = Api::namespaced(client.clone(), &id);
    let roles: Api<DatabaseRole> = Api::namespaced(client.clone(), &id);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &id);
    let pp = PostParams::default();
    let role = |name: &str, db: &str| {
        DatabaseRole::new(
            name,
            DatabaseRoleSpec {
                database_ref: LocalRef { name: db.into() },
                role_name: name.replace('-', "_"),
                privileges: Privileges::ReadOnly,
                password_rotation: None,
                adopt: false,
                deletion_policy: DeletionPolicy::Retain,
            },
        )
    };
    // A cluster on each shard (their keys are `<namespace>/<name>`).
    let mut names: Vec<String> = Vec::new();
    for c in 'a'..='z' {
        let name = format!("pg-{c}");
        let shard = shard_of(&format!("{id}/{name}"), SHARDS);
        if names
            .iter()
            .all(|n| shard_of(&format!("{id}/{n}"), SHARDS) != shard)
        {
            names.push(name);
        }
        if names.len() == SHARDS as usize {
            break;
        }
    }
    assert_eq!(
        names.len(),
        SHARDS as usize,
        "a cluster name for each shard"
    );
    // Each cluster's Database (and the first one's DatabaseRole), kept from connecting.
    let mut cluster_objects: Vec<(&str, String, String)> = Vec::new();
    for (i, cluster) in names.iter().enumerate() {
        clusters
            .create(&pp, &fixtures::postgres_cluster(cluster, 1).build())
            .await
            .expect("PostgresCluster");
        let db = format!("app-{cluster}");
        secrets
            .create(
                &pp,
                &fixtures::secret(&format!("{db}-db-credentials"), [("x", "y")]),
            )
            .await
            .expect("a Secret of the test's");
        let mut spec = DatabaseSpec::on(
            ExternalServer::plain("unused", 1, "unused"),
            "app",
            "app_owner",
        );
        spec.external = None;
        spec.cluster_ref = Some(LocalRef {
            name: cluster.clone(),
        });
        databases
            .create(&pp, &Database::new(&db, spec))
            .await
            .expect("Database");
        cluster_objects.push(("Database", db.clone(), cluster.clone()));
        if i == 0 {
            let r = format!("reader-{cluster}");
            secrets
                .create(
                    &pp,
                    &fixtures::secret(&format!("{r}-role-credentials"), [("x", "y")]),
                )
                .await
                .expect("a Secret of the test's");
            roles
                .create(&pp, &role(&r, &db))
                .await
                .expect("DatabaseRole");
            cluster_objects.push(("DatabaseRole", r, cluster.clone()));
        }
    }
    // A Database and a DatabaseRole on each external server. Each server is named
    // `127.0.0.1` or `localhost` (this machine both, from /etc/hosts), so that the two are on
    // two shards where some choice allows (their ports, free ones, decide the rest).
    let server_shard_as = |host: &str, i: usize| {
        shard_of(
            &server_key(&ExternalServer::plain(host, pgs[i].port(), "any")),
            SHARDS,
        )
    };
    let spellings = ["127.0.0.1", "localhost"];
    let hosts = spellings
        .iter()
        .flat_map(|a| spellings.iter().map(move |b| [*a, *b]))
        .find(|[a, b]| server_shard_as(a, 0) != server_shard_as(b, 1))
        .unwrap_or(["127.0.0.1", "127.0.0.1"]);
    let server_shard = |i: usize| server_shard_as(hosts[i], i);
    let mut server_objects: Vec<(&str, String, usize)> = Vec::new();
    for (i, pg) in pgs.iter().enumerate() {
        let admin = format!("admin-{i}");
        secrets
            .create(
                &pp,
                &fixtures::secret(
                    &admin,
                    [("username", pg.superuser()), ("password", pg.password())],
                ),
            )
            .await
            .expect("admin Secret");
        let db = format!("ext-{i}");
        let spec = DatabaseSpec::on(
            ExternalServer::plain(hosts[i], pg.port(), &admin),
            &format!("ext_{i}"),
            &format!("ext_owner_{i}"),
        );
        databases
            .create(&pp, &Database::new(&db, spec))
            .await
            .expect("Database");
        let r = format!("ext-reader-{i}");
        roles
            .create(&pp, &role(&r, &db))
            .await
            .expect("DatabaseRole");
        server_objects.push(("Database", db, i));
        server_objects.push(("DatabaseRole", r, i));
    }
    let label_of = |labels: &BTreeMap<String, String>| labels.get(SHARD_LABEL).cloned();

    // Labels: each cluster on its own key's shard, its Database and DatabaseRole on the
    // cluster's label, an external server's objects on the server's shard.
    eventually("every object labelled with its shard", WAIT, || async {
        let mut wrong = Vec::new();
        for cluster in &names {
            let c = clusters.get(cluster).await.map_err(|e| e.to_string())?;
            let want = shard_of(&format!("{id}/{cluster}"), SHARDS).to_string();
            if label_of(c.labels()) != Some(want.clone()) {
                wrong.push(format!(
                    "PostgresCluster {cluster}: {:?}",
                    label_of(c.labels())
                ));
            }
        }
        for (kind, name, cluster) in &cluster_objects {
            let cluster_label = label_of(
                clusters
                    .get(cluster)
                    .await
                    .map_err(|e| e.to_string())?
                    .labels(),
            );
            let (label, _) = database_or_role(&databases, &roles, kind, name).await?;
            if label.is_none() || label != cluster_label {
                wrong.push(format!(
                    "{kind} {name}: {label:?}, its cluster {cluster_label:?}"
                ));
            }
        }
        for (kind, name, server) in &server_objects {
            let (label, _) = database_or_role(&databases, &roles, kind, name).await?;
            if label != Some(server_shard(*server).to_string()) {
                wrong.push(format!("{kind} {name}: {label:?}"));
            }
        }
        wrong
            .is_empty()
            .then_some(())
            .ok_or_else(|| wrong.join("; "))
    })
    .await
    .expect("every object labelled with its cluster's or server's shard");

    // Everything converges: each cluster's status describes its generation and its
    // StatefulSet carries its shard; the cluster's Database and DatabaseRole are refused
    // (their Secret is not theirs); the external ones are Ready, their Secrets on their shard.
    eventually("every object converged", WAIT, || async {
        let mut waiting = Vec::new();
        for cluster in &names {
            let c = clusters.get(cluster).await.map_err(|e| e.to_string())?;
            let observed = c.status.as_ref().and_then(|s| s.observed_generation);
            let sts = Api::<StatefulSet>::namespaced(client.clone(), &id)
                .get_opt(cluster)
                .await
                .map_err(|e| e.to_string())?;
            if observed != c.metadata.generation
                || sts.is_none_or(|s| label_of(s.labels()) != label_of(c.labels()))
            {
                waiting.push(format!("PostgresCluster {cluster}"));
            }
        }
        for (kind, name, _) in &cluster_objects {
            let (_, r) = database_or_role(&databases, &roles, kind, name).await?;
            if r.as_ref()
                .is_none_or(|(s, reason)| s != "False" || reason != "SecretConflict")
            {
                waiting.push(format!("{kind} {name}: {r:?}"));
            }
        }
        for (kind, name, _) in &server_objects {
            let (label, r) = database_or_role(&databases, &roles, kind, name).await?;
            let secret = match *kind {
                "Database" => format!("{name}-db-credentials"),
                _ => format!("{name}-role-credentials"),
            };
            let secret_label = secrets
                .get_opt(&secret)
                .await
                .map_err(|e| e.to_string())?
                .and_then(|s| label_of(s.labels()));
            if r.as_ref().is_none_or(|(s, _)| s != "True") || secret_label != label {
                waiting.push(format!("{kind} {name}: {r:?}, Secret on {secret_label:?}"));
            }
        }
        waiting
            .is_empty()
            .then_some(())
            .ok_or_else(|| waiting.join("; "))
    })
    .await
    .expect("every object converged");
    eprintln!("converged after {:?}", started.elapsed());

    // One writer per object: its shard's holder, which did not change meanwhile.
    let now: Vec<String> = holders(&client, &id, &id)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(now, settled, "no shard changed hands");
    let holder_of = |shard: u32| settled[shard as usize].clone();
    let shard_of_cluster = |cluster: &str| shard_of(&format!("{id}/{cluster}"), SHARDS);
    let reported = reporters(&client, &id).await;
    let mut expected: Vec<(&str, String, u32)> = Vec::new();
    for (kind, name, cluster) in &cluster_objects {
        expected.push((kind, name.clone(), shard_of_cluster(cluster)));
    }
    for (kind, name, server) in &server_objects {
        expected.push((kind, name.clone(), server_shard(*server)));
    }
    for (kind, name, shard) in &expected {
        let by = reported
            .get(&(kind.to_string(), name.clone()))
            .cloned()
            .unwrap_or_default();
        eprintln!("{kind} {name} (shard {shard}): Events by {by:?}");
        let writers: Vec<&String> = by.keys().collect();
        assert_eq!(
            writers,
            vec![&holder_of(*shard)],
            "{kind} {name}: reported by its shard's holder alone"
        );
    }
    for (i, pg) in pgs.iter().enumerate() {
        let by = sessions(&pg.log_text());
        eprintln!(
            "server {i} ({}:{}, shard {}): statements by {by:?}",
            hosts[i],
            pg.port(),
            server_shard(i)
        );
        assert_eq!(
            by.keys().collect::<Vec<_>>(),
            vec![&holder_of(server_shard(i))],
            "server {i}: written by its shard's holder alone"
        );
    }
    // Each cluster's gauges on one replica, its shard's holder (it caches it alone).
    eventually("each cluster's gauge on one replica", WAIT, || async {
        let scraped: Vec<String> = replicas.iter().map(|r| r.metrics.encode()).collect();
        for cluster in &names {
            let series = format!(
                "steward_postgrescluster_instances{{namespace=\"{id}\",cluster=\"{cluster}\"}}"
            );
            let on: Vec<&String> = (0..scraped.len())
                .filter(|&i| scraped[i].lines().any(|l| l.starts_with(&series)))
                .map(|i| &replicas[i].identity)
                .collect();
            if on != vec![&holder_of(shard_of_cluster(cluster))] {
                return Err(format!("{cluster}: on {on:?}"));
            }
        }
        Ok(())
    })
    .await
    .expect("per-cluster gauges follow the shards");
    eprintln!("done after {:?}", started.elapsed());
    drop(replicas);
}

/// The shard label and the `Ready` condition (status, reason) of the Database (`kind`
/// `"Database"`) or DatabaseRole `name`.
async fn database_or_role(
    databases: &Api<database_operator::crd::Database>,
    roles: &Api<database_operator::crd::DatabaseRole>,
    kind: &str,
    name: &str,
) -> Result<(Option<String>, Option<(String, String)>), String> {
    let (labels, conditions) = match kind {
        "Database" => {
            let d = databases.get(name).await.map_err(|e| e.to_string())?;
            (d.metadata.labels, d.status.map(|s| s.conditions))
        }
        _ => {
            let r = roles.get(name).await.map_err(|e| e.to_string())?;
            (r.metadata.labels, r.status.map(|s| s.conditions))
        }
    };
    let ready = conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| (c.status, c.reason));
    Ok((labels.and_then(|l| l.get(SHARD_LABEL).cloned()), ready))
}
