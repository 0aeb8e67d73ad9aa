//! Disaster recovery across Kubernetes clusters (issue #42): two control planes on the machine,
//! each with a real node and its own database-operator, sharing nothing but an object store on
//! the host (and routed pod addresses, which these tests do not use). A standby PostgresCluster
//! in the second follows a source in the first through the source's archive; the source's
//! whole control plane is killed and the standby promoted; a planned switchover goes there and
//! back under writes. The clusters take turns on the machine's real nodes.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use steward_testenv::eventually;

#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/real_node.rs"]
mod support;
use postgres::*;
use support::{connect, logs};

/// The instance status pod `pod` publishes, if any.
async fn instance_status(
    cluster: &Cluster,
    pod: &str,
) -> Option<steward_pg_instance::contract::InstanceStatus> {
    let pod = cluster.pods().get_opt(pod).await.ok()??;
    let raw = pod
        .annotations()
        .get(steward_pg_instance::contract::STATUS_ANNOTATION)?
        .clone();
    serde_json::from_str(&raw).ok()
}

/// `archive_timeout` of the sources and `wal_retrieve_retry_interval` of the standbys: how
/// often a WAL segment reaches the store, and how often a standby looks for the next one.
const ARCHIVE_TIMEOUT: Duration = Duration::from_secs(2);
const RETRIEVE_RETRY: Duration = Duration::from_secs(1);

/// The parameters of every cluster of these tests (each becomes a source or a standby).
fn parameters() -> serde_json::Value {
    json!({"archive_timeout": format!("{}s", ARCHIVE_TIMEOUT.as_secs()),
           "wal_retrieve_retry_interval": format!("{}s", RETRIEVE_RETRY.as_secs())})
}

/// Waits until `pod` of `cluster` leads a standby that follows its source (it listed the
/// source's archive): what it reports.
async fn following(cluster: &Cluster, pod: &str) -> steward_pg_instance::contract::Following {
    use steward_pg_instance::contract::Role;
    let followed = eventually(
        &format!("{pod} follows"),
        Duration::from_secs(300),
        || async {
            let status = instance_status(cluster, pod).await;
            match &status {
                Some(s) if s.role == Role::Replica => s
                    .following
                    .clone()
                    .filter(|f| f.source_wal.is_some())
                    .ok_or_else(|| format!("{status:?}")),
                _ => Err(format!("{status:?}")),
            }
        },
    )
    .await;
    match followed {
        Ok(f) => f,
        Err(e) => panic!("{e}\n--- {pod}:\n{}", logs(&cluster.pods(), pod).await),
    }
}

/// Creates `cluster`'s PostgresCluster `pg` archiving to `store` (with this file's
/// parameters), the table `acks` in it and a completed base backup `first`, which a standby
/// restores; its `-rw` address.
async fn backed_up_source(cluster: &mut Cluster, store: &serde_json::Value) -> String {
    cluster
        .create(json!({"backup": {"objectStore": store}, "parameters": parameters()}))
        .await;
    let rw = cluster.cluster_ip("pg-rw").await;
    let db = connect(&rw, &cluster.password).await.unwrap();
    db.batch_execute("create table acks (id bigint primary key)")
        .await
        .unwrap();
    create_backup(cluster, "first", "pg").await;
    completed_backup(cluster, "first").await;
    rw
}

/// Creates PostgresCluster `pg` of `instances` in `cluster` with `spec` (and this file's
/// parameters); does not wait.
async fn create_pg(cluster: &Cluster, instances: i32, mut spec: serde_json::Value) {
    spec["parameters"] = parameters();
    let manifest = cluster.manifest("pg", instances, spec);
    steward_testenv::manifests::apply(&cluster.client, &manifest, None, "real-node-test", false)
        .await
        .unwrap();
}

/// Disaster recovery, unplanned: in a second Kubernetes cluster, a standby of two instances
/// (`spec.replica`) restores the source's base backup and follows its archive under a steady
/// write load (its lag measured). The source's Kubernetes cluster is then killed whole (its
/// node's processes, PostgreSQL's included, and its control plane's, SIGKILL; its operator),
/// and the standby promoted by the documented step (`spec.replica.enabled: false`): no row the
/// source acknowledged more than the archive's bound before it died is lost, the standby
/// writes, and it fenced the source's store. The source's Kubernetes cluster brought back,
/// its PostgreSQL never runs read-write; re-created as a standby of the new primary it follows
/// it.
#[tokio::test]
async fn a_standby_in_another_kubernetes_cluster_is_promoted_when_the_source_cluster_dies() {
    use steward_pg_instance::contract::Role;

    let _turn = NODE.lock().await;
    let (mut source, standby) = Cluster::pair("rn-pgdr", [1, 2]).await;
    // An operator that can be killed with its Kubernetes cluster.
    source.stop_operator().await;
    source.start_killable_operator().await;
    let (s3, source_store, store) = object_store(&source, "pg").await;
    let (standby_store, _) = store_on(&standby, &s3, "pg").await;
    let rw = backed_up_source(&mut source, &source_store).await;
    archiving(&source, &s3).await;
    let (acks, stop, writing) = start_writer(&rw, &source.password, 20).await;

    let created = Instant::now();
    create_pg(
        &standby,
        2,
        json!({"replica": {"source": source_store}, "backup": {"objectStore": standby_store}}),
    )
    .await;
    let followed = following(&standby, "pg-0").await;
    eprintln!(
        "standby following {:.1?} after it was created: {followed:?}",
        created.elapsed()
    );
    assert_eq!(followed.source, format!("s3://{BUCKET}/{}/pg", source.ns));
    eventually(
        "the standby's second instance replays the source too",
        Duration::from_secs(300),
        || async {
            match instance_status(&standby, "pg-1").await {
                Some(s) if s.role == Role::Replica && s.lsn.0 > 0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
    .unwrap();

    // Lag under the writer's steady load: how old the first row the standby lacks is.
    let standby_rw = standby.wait_cluster_ip("pg-rw").await;
    let mut lags = Vec::new();
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok(db) = connect(&standby_rw, &source.password).await else {
            continue;
        };
        let Some(newest) = db
            .query_one("select max(id) from acks", &[])
            .await
            .ok()
            .and_then(|r| r.get::<_, Option<i64>>(0))
        else {
            continue;
        };
        let lag = {
            let acks = acks.lock().unwrap();
            let next = acks.rows.iter().find(|(id, _, _)| *id > newest);
            next.map_or(Duration::ZERO, |(_, t, _)| t.elapsed())
        };
        lags.push(lag);
    }
    lags.sort();
    assert!(lags.len() >= 10, "{} lag samples", lags.len());
    let reported = instance_status(&standby, "pg-0").await.unwrap().following;
    eprintln!(
        "standby lag under writes (1 row / 50 ms): median {:.1?}, max {:.1?}; its leader reports {reported:?}",
        lags[lags.len() / 2],
        lags[lags.len() - 1],
    );
    // It reads the source's WAL no sooner than it is archived and looked for.
    let bound = (ARCHIVE_TIMEOUT + RETRIEVE_RETRY) * 4;
    assert!(
        lags[lags.len() / 2] < bound,
        "median lag {:.1?} over {bound:?}",
        lags[lags.len() / 2]
    );
    let refused = connect(&standby_rw, &source.password)
        .await
        .unwrap()
        .execute("insert into acks values (-1)", &[])
        .await
        .unwrap_err();
    assert!(
        format!("{refused:?}").contains("read-only"),
        "a standby took a write: {refused:?}"
    );

    // The source's Kubernetes cluster dies whole, mid-writes.
    let killed = Instant::now();
    source.kill_operator();
    source._cp.real_node_mut(0).unwrap().stop().unwrap();
    source._cp.kill_all();
    stop.cancel();
    writing.await.unwrap();
    let lag_then = instance_status(&standby, "pg-0").await.unwrap().following;

    // The documented step.
    let promoting = Instant::now();
    standby
        .clusters()
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replica": {"enabled": false}}})),
        )
        .await
        .unwrap();
    let standby_password = standby.superuser_password("pg").await;
    let promoted = eventually(
        "the standby accepts writes",
        Duration::from_secs(120),
        || {
            let (standby_rw, password) = (standby_rw.clone(), standby_password.clone());
            async move {
                let db = connect(&standby_rw, &password)
                    .await
                    .map_err(|e| e.to_string())?;
                db.execute("insert into acks values (-1)", &[])
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(db)
            }
        },
    )
    .await;
    let promoted = match promoted {
        Ok(db) => db,
        Err(e) => panic!("{e}\n--- pg-0:\n{}", logs(&standby.pods(), "pg-0").await),
    };
    eprintln!(
        "promoted: writes accepted {:.1?} after the step",
        promoting.elapsed()
    );
    let present: std::collections::BTreeSet<i64> = promoted
        .query("select id from acks where id > 0", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (lost, total): (Vec<(i64, Duration)>, usize) = {
        let acks = acks.lock().unwrap();
        let lost = acks
            .rows
            .iter()
            .filter(|(id, _, _)| !present.contains(id))
            .map(|(id, at, _)| (*id, killed.saturating_duration_since(*at)))
            .collect();
        (lost, acks.rows.len())
    };
    eprintln!(
        "{} of {total} acknowledged rows lost, acknowledged at most {:.1?} before the source's cluster died; the standby's last report then: {lag_then:?}",
        lost.len(),
        lost.iter()
            .map(|(_, before)| *before)
            .max()
            .unwrap_or_default()
    );
    // What the source had not archived: at most an archive_timeout's worth, and the upload.
    let archive_bound = ARCHIVE_TIMEOUT * 3;
    assert!(
        lost.iter().all(|(_, before)| *before < archive_bound),
        "rows acknowledged more than {archive_bound:?} before the source died are lost: {lost:?}"
    );
    let fence = store
        .fence()
        .await
        .unwrap()
        .expect("the source's store fenced");
    assert_eq!(fence.promoted, format!("{}/pg", standby.ns), "{fence:?}");
    assert_eq!(fence.timeline, 1, "{fence:?}");

    // The source's Kubernetes cluster comes back: its PostgreSQL never runs read-write.
    let back = Instant::now();
    source
        ._cp
        .start_all_again(Duration::from_secs(120))
        .await
        .unwrap();
    let client = source.client.clone();
    source
        ._cp
        .real_node_mut(0)
        .unwrap()
        .start_again(&client, Duration::from_secs(120))
        .await
        .unwrap();
    source.start_killable_operator().await;
    eprintln!(
        "the source's Kubernetes cluster back in {:.1?}",
        back.elapsed()
    );
    let passwords = [source.password.as_str(), standby_password.as_str()];
    let why = eventually(
        "the source says it is fenced",
        Duration::from_secs(180),
        || async {
            let status = instance_status(&source, "pg-0").await;
            match status.as_ref().and_then(|s| s.problem.clone()) {
                Some(p) if p.contains("fenced by") => Ok(p),
                _ => Err(format!("{status:?}")),
            }
        },
    )
    .await;
    let why = match why {
        Ok(why) => why,
        Err(e) => panic!("{e}\n--- pg-0:\n{}", logs(&source.pods(), "pg-0").await),
    };
    eprintln!("the source came back: {why}");
    let watched = Instant::now();
    let mut conn = None;
    while watched.elapsed() < steward_pg_instance::standby::FENCE_CHECK * 2 {
        let status = instance_status(&source, "pg-0").await;
        assert!(
            status.as_ref().is_none_or(|s| s.role != Role::Primary),
            "the fenced source runs read-write: {status:?}"
        );
        assert_ne!(
            read_write(&mut conn, &rw, &passwords).await,
            Some(true),
            "the fenced source runs read-write"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // It rejoins as a standby of the new primary: re-created from its newest base backup.
    create_backup(&standby, "promoted", "pg").await;
    completed_backup(&standby, "promoted").await;
    source
        .clusters()
        .delete("pg", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the fenced source's pod and volume gone",
        Duration::from_secs(120),
        || async {
            let pod = source
                .pods()
                .get_opt("pg-0")
                .await
                .map_err(|e| e.to_string())?;
            let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
                Api::namespaced(source.client.clone(), &source.ns);
            let claim = claims
                .get_opt("data-pg-0")
                .await
                .map_err(|e| e.to_string())?;
            match (pod, claim) {
                (None, None) => Ok(()),
                other => Err(format!(
                    "{:?}",
                    (other.0.map(|p| p.name_any()), other.1.map(|c| c.name_any()))
                )),
            }
        },
    )
    .await
    .unwrap();
    create_pg(
        &source,
        1,
        json!({"replica": {"source": standby_store}, "backup": {"objectStore": source_store}}),
    )
    .await;
    promoted
        .batch_execute("insert into acks values (-3); select pg_switch_wal()")
        .await
        .unwrap();
    following(&source, "pg-0").await;
    let rw = source.wait_cluster_ip("pg-rw").await;
    let rejoined = eventually(
        "the rejoined source serves the new primary's rows",
        Duration::from_secs(180),
        || async {
            let db = connect(&rw, &standby_password)
                .await
                .map_err(|e| e.to_string())?;
            let n: i64 = db
                .query_one("select count(*) from acks where id = -3", &[])
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            if n == 1 {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await;
    if let Err(e) = rejoined {
        panic!("{e}\n--- pg-0:\n{}", logs(&source.pods(), "pg-0").await);
    }
}

/// Whether the server behind `host` runs read-write, asked over a connection kept in `conn`
/// (made again with each of `passwords` when it broke); `None`: it did not answer.
async fn read_write(
    conn: &mut Option<tokio_postgres::Client>,
    host: &str,
    passwords: &[&str],
) -> Option<bool> {
    if conn.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
        *conn = None;
        for password in passwords {
            if let Ok(Ok(c)) =
                tokio::time::timeout(Duration::from_secs(1), connect(host, password)).await
            {
                *conn = Some(c);
                break;
            }
        }
    }
    let c = conn.as_ref()?;
    match tokio::time::timeout(
        Duration::from_secs(1),
        c.query_one("select pg_is_in_recovery()", &[]),
    )
    .await
    {
        Ok(Ok(row)) => Some(!row.get::<_, bool>(0)),
        _ => {
            *conn = None;
            None
        }
    }
}

/// Inserts one row every 50 ms into whichever of `sites` (`-rw` address, superuser passwords)
/// takes it, starting with the first, moving to the next when one refuses or does not answer;
/// records what was acknowledged (and the `-rw` address that did).
async fn following_writer(
    sites: Vec<(String, Vec<String>)>,
    acks: Arc<Mutex<Acks>>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut id: i64 = 0;
    let mut at = 0;
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.is_cancelled() {
        let (host, passwords) = &sites[at];
        if client
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
        {
            client = None;
            for password in passwords {
                if let Ok(Ok(c)) =
                    tokio::time::timeout(Duration::from_secs(1), connect(host, password)).await
                {
                    client = Some(c);
                    break;
                }
            }
        }
        let Some(c) = client.as_ref() else {
            at = (at + 1) % sites.len();
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        id += 1;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&id];
        let insert = c.execute("insert into acks (id) values ($1)", &params);
        match tokio::time::timeout(Duration::from_secs(2), insert).await {
            Ok(Ok(_)) => acks
                .lock()
                .unwrap()
                .rows
                .push((id, Instant::now(), host.clone())),
            Ok(Err(e)) if format!("{e:?}").contains("read-only") => {
                // Refused by a standby: not written anywhere.
                client = None;
                at = (at + 1) % sites.len();
            }
            _ => {
                acks.lock().unwrap().unsure.push(id);
                client = None;
                at = (at + 1) % sites.len();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The demotion token on PostgresCluster `name`'s Lease, once there is one.
async fn demotion_token(cluster: &Cluster, name: &str) -> String {
    use k8s_openapi::api::coordination::v1::Lease;
    use steward_pg_instance::contract;
    let leases: Api<Lease> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    let token = eventually(
        &format!("{name}'s demotion token"),
        Duration::from_secs(180),
        || {
            let leases = leases.clone();
            async move {
                let lease = leases
                    .get(&contract::lease_name(name))
                    .await
                    .map_err(|e| e.to_string())?;
                lease
                    .annotations()
                    .get(contract::DEMOTION_TOKEN_ANNOTATION)
                    .cloned()
                    .ok_or_else(|| format!("{:?}", lease.annotations()))
            }
        },
    )
    .await;
    match token {
        Ok(t) => t,
        Err(e) => panic!(
            "{e}\n--- {name}-0:\n{}",
            logs(&cluster.pods(), &format!("{name}-0")).await
        ),
    }
}

/// Disaster recovery, planned, across two Kubernetes clusters: under a steady write load that
/// follows whichever cluster takes writes, the source is demoted (`spec.replica` on it: it
/// stops cleanly, archives its WAL to the end and publishes its demotion token), the standby
/// in the other Kubernetes cluster promoted with that token (it replays all of it first), then
/// back the same way. Throughout, both clusters' `-rw` endpoints are probed: never both
/// read-write. No acknowledged row is lost; each switchover's write unavailability is
/// measured.
#[tokio::test]
async fn a_planned_switchover_to_another_kubernetes_cluster_and_back_loses_no_acknowledged_row() {
    let _turn = NODE.lock().await;
    let (mut a, b) = Cluster::pair("rn-pgsw", [1, 1]).await;
    let (s3, a_store, _) = object_store(&a, "pg").await;
    let (b_store, _) = store_on(&b, &s3, "pg").await;
    let a_rw = backed_up_source(&mut a, &a_store).await;
    create_pg(
        &b,
        1,
        json!({"replica": {"source": a_store}, "backup": {"objectStore": b_store}}),
    )
    .await;
    following(&b, "pg-0").await;
    let b_rw = b.wait_cluster_ip("pg-rw").await;
    let b_password = b.superuser_password("pg").await;
    let passwords = vec![a.password.clone(), b_password.clone()];

    // The writer and the probe of both clusters' -rw.
    let test_started = Instant::now();
    let acks = Arc::new(Mutex::new(Acks::default()));
    let stop = tokio_util::sync::CancellationToken::new();
    let writing = tokio::spawn(following_writer(
        vec![
            (a_rw.clone(), passwords.clone()),
            (b_rw.clone(), passwords.clone()),
        ],
        acks.clone(),
        stop.clone(),
    ));
    let two_primaries = Arc::new(Mutex::new(Vec::<Duration>::new()));
    let probing = tokio::spawn({
        let (a_rw, b_rw, stop, seen) = (
            a_rw.clone(),
            b_rw.clone(),
            stop.clone(),
            two_primaries.clone(),
        );
        let passwords = passwords.clone();
        async move {
            let pw: Vec<&str> = passwords.iter().map(String::as_str).collect();
            let (mut on_a, mut on_b) = (None, None);
            while !stop.is_cancelled() {
                let both = (
                    read_write(&mut on_a, &a_rw, &pw).await,
                    read_write(&mut on_b, &b_rw, &pw).await,
                );
                if both == (Some(true), Some(true)) {
                    seen.lock().unwrap().push(test_started.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    acknowledged(
        "40 acknowledged writes",
        &acks,
        40,
        Duration::from_secs(240),
    )
    .await;

    let mut gaps = Vec::new();
    let mut steps = Vec::new();
    // There (a demoted, following b's store; b promoted), and back.
    for (from, to, to_rw, to_store) in [(&a, &b, &b_rw, &b_store), (&b, &a, &a_rw, &a_store)] {
        let started = Instant::now();
        steps.push(format!(
            "{} demoted at {:.1?}",
            from.ns,
            started.duration_since(test_started)
        ));
        from.clusters()
            .patch(
                "pg",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replica": {"enabled": true, "source": to_store}}})),
            )
            .await
            .unwrap();
        let token = demotion_token(from, "pg").await;
        eprintln!(
            "{} demoted {:.1?} after the step: token {token}",
            from.ns,
            started.elapsed()
        );
        to.clusters()
            .patch(
                "pg",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"spec": {"replica": {"enabled": false, "promotionToken": token}}}),
                ),
            )
            .await
            .unwrap();
        let n = acks.lock().unwrap().rows.len();
        let resumed = eventually(
            &format!("writes on {}", to.ns),
            Duration::from_secs(240),
            || {
                let acks = acks.clone();
                async move {
                    let acks = acks.lock().unwrap();
                    acks.rows[n..]
                        .iter()
                        .find(|(_, _, host)| host == to_rw)
                        .map(|_| ())
                        .ok_or_else(|| format!("{} writes since", acks.rows.len() - n))
                }
            },
        )
        .await;
        if let Err(e) = resumed {
            panic!(
                "{e}\n--- {} pg-0:\n{}\n--- {} pg-0:\n{}",
                to.ns,
                logs(&to.pods(), "pg-0").await,
                from.ns,
                logs(&from.pods(), "pg-0").await
            );
        }
        let gap = longest_gap(&acks, started);
        eprintln!(
            "switchover {} -> {}: writes resumed {:.1?} after the step; longest write gap {gap:.1?}",
            from.ns,
            to.ns,
            started.elapsed()
        );
        gaps.push(gap);
        let n = acks.lock().unwrap().rows.len() + 40;
        acknowledged(
            &format!("{n} acknowledged writes"),
            &acks,
            n,
            Duration::from_secs(240),
        )
        .await;
    }
    stop.cancel();
    writing.await.unwrap();
    probing.await.unwrap();
    let both = two_primaries.lock().unwrap().clone();
    assert!(both.is_empty(), "both clusters ran read-write at {both:?}");
    // Every acknowledged row is on the primary at the end (a again).
    let db = connect(&a_rw, &a.password).await.unwrap();
    let there: std::collections::BTreeSet<i64> = db
        .query("select id from acks", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (lost, total, unsure) = {
        let acks = acks.lock().unwrap();
        let lost: Vec<String> = acks
            .rows
            .iter()
            .filter(|(id, _, _)| !there.contains(id))
            .map(|(id, at, host)| {
                format!("{id} by {host} at {:.1?}", at.duration_since(test_started))
            })
            .collect();
        (lost, acks.rows.len(), acks.unsure.len())
    };
    if !lost.is_empty() {
        panic!(
            "{} of {total} acknowledged rows lost: {lost:?} (steps: {steps:?})\n--- a pg-0:\n{}\n--- b pg-0:\n{}",
            lost.len(),
            logs(&a.pods(), "pg-0").await,
            logs(&b.pods(), "pg-0").await
        );
    }
    eprintln!(
        "{total} acknowledged rows, none lost; {unsure} unsure; longest write gaps {gaps:.1?}"
    );
    a.stop_operator().await;
}
