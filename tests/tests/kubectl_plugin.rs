//! `kubectl steward` as users run it: the `kubectl-steward` binary on the `PATH` of the control
//! plane's own kubectl, against the control plane. The upgrade-orchestrator runs in-process,
//! so an approval or a pause given through the plugin is seen to move (or hold) a real plan
//! over Deployments on kwok nodes. The database and tenant objects carry the statuses their
//! operators write (set here through the status subresource), so what the plugin shows and
//! writes is checked without PostgreSQL (the database-operator's own tests cover what it does
//! with a switchover or rotation annotation). `logs` runs in the real-node test, where the
//! operators run as pods.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use database_operator::{DatabaseRole, PostgresCluster};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use steward_core::Operator;
use steward_core::cli::CommonArgs;
use steward_testenv::{ControlPlane, eventually, harness};
use upgrade_orchestrator::UpgradePlan;

const WAIT: Duration = Duration::from_secs(120);

/// `kubectl <args>` with `kubectl-steward` on the PATH: (success, stdout, stderr).
fn kubectl(cp: &ControlPlane, plugin_dir: &Path, args: &[&str]) -> (bool, String, String) {
    let ran = harness::kubectl(cp, plugin_dir, args).expect("run kubectl");
    (ran.success, ran.stdout, ran.stderr)
}

fn plugin() -> PathBuf {
    harness::kubectl_steward().expect("build kubectl-steward")
}

async fn control_plane() -> &'static ControlPlane {
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.install_crds(&steward_testenv::workspace_root().join("crds"))
        .await
        .expect("CRDs");
    cp
}

/// `kubectl steward status -n <ns> -o json`, parsed.
fn status_json(cp: &ControlPlane, dir: &Path, ns: &str) -> Value {
    let (ok, out, err) = kubectl(cp, dir, &["steward", "status", "-n", ns, "-o", "json"]);
    assert!(ok, "status failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status -o json: {e}: {out}"))
}

async fn image_of(deployments: &Api<Deployment>, name: &str) -> String {
    deployments
        .get(name)
        .await
        .expect("deployment")
        .spec
        .template
        .spec
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.image)
        .unwrap_or_default()
}

/// The plan's row in `status -o json` once `done` holds for it.
async fn wait_plan(
    cp: &ControlPlane,
    dir: &Path,
    ns: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    eventually(what, WAIT, || {
        let row = status_json(cp, dir, ns)["upgradePlans"][0].clone();
        let ok = done(&row);
        async move { if ok { Ok(row) } else { Err(row.to_string()) } }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_pause_and_resume_move_a_real_plan() {
    let dir = plugin();
    let cp = control_plane().await;
    let ns = cp.namespace("plugin-plan").await.expect("namespace");
    let client = cp.client().expect("client");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for (name, image) in [("a", "a:1"), ("b", "b:1")] {
        deployments
            .create(
                &PostParams::default(),
                &steward_integration_tests::deployment(name, image, 1),
            )
            .await
            .expect("create deployment");
    }
    let args = CommonArgs {
        watch_namespace: Some(ns.clone()),
        ..harness::test_args()
    };
    let mut op = Operator::with_config(upgrade_orchestrator::NAME, args, cp.config().clone())
        .expect("operator")
        .backoff(Duration::from_millis(200), Duration::from_secs(2));
    let options = upgrade_orchestrator::Options {
        watch_postgresclusters: false,
        ..Default::default()
    };
    upgrade_orchestrator::register(&mut op, options).expect("register");
    let orchestrator = harness::Harness::start(op).await;

    let plan: UpgradePlan = serde_json::from_value(json!({
        "apiVersion": "upgrade.steward.dev/v1alpha1",
        "kind": "UpgradePlan",
        "metadata": {"name": "gated"},
        "spec": {
            "components": [
                {"name": "a", "target": {"kind": "Deployment", "name": "a"}, "image": {"container": "app", "image": "a:2"}},
                {"name": "b", "target": {"kind": "Deployment", "name": "b"}, "image": {"container": "app", "image": "b:2"}, "dependsOn": ["a"]},
            ],
            "strategy": {"approval": "Manual"},
        },
    }))
    .expect("plan");
    Api::<UpgradePlan>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &plan)
        .await
        .expect("create plan");

    let row = wait_plan(cp, &dir, &ns, "wave 1 waits for approval", |r| {
        r["phase"] == "WaitingApproval"
    })
    .await;
    assert_eq!(
        row["next"],
        "wave 1 waits for approval: kubectl steward approve gated"
    );
    assert_eq!(
        image_of(&deployments, "a").await,
        "a:1",
        "nothing moves unapproved"
    );

    // Paused takes precedence over the approval it waits for; resume gives it back.
    let (ok, out, err) = kubectl(cp, &dir, &["steward", "pause", "gated", "-n", &ns]);
    assert!(ok, "pause: {err}");
    assert_eq!(out, "upgradeplan/gated paused\n");
    let row = wait_plan(cp, &dir, &ns, "paused", |r| r["phase"] == "Paused").await;
    assert_eq!(row["next"], "paused: kubectl steward resume gated");
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "resume", "gated", "-n", &ns]);
    assert!(ok, "resume: {err}");
    wait_plan(cp, &dir, &ns, "waiting again", |r| {
        r["phase"] == "WaitingApproval"
    })
    .await;

    let (ok, out, err) = kubectl(cp, &dir, &["steward", "approve", "gated", "-n", &ns]);
    assert!(ok, "approve: {err}");
    assert_eq!(out, "upgradeplan/gated: waves up to 1 approved\n");
    wait_plan(cp, &dir, &ns, "wave 2 waits for approval", |r| {
        r["phase"] == "WaitingApproval" && r["currentWave"] == 2
    })
    .await;
    assert_eq!(image_of(&deployments, "a").await, "a:2", "wave 1 rolled");
    assert_eq!(image_of(&deployments, "b").await, "b:1", "wave 2 waits");

    let (ok, _, err) = kubectl(
        cp,
        &dir,
        &["steward", "approve", "gated", "--wave", "2", "-n", &ns],
    );
    assert!(ok, "approve --wave 2: {err}");
    wait_plan(cp, &dir, &ns, "the plan succeeds", |r| {
        r["phase"] == "Succeeded"
    })
    .await;
    assert_eq!(image_of(&deployments, "b").await, "b:2");

    // What makes no sense is refused, with the reason, and exits non-zero.
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "approve", "gated", "-n", &ns]);
    assert!(
        !ok && err.contains("not approved: it is over (Succeeded)"),
        "{err}"
    );
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "pause", "nope", "-n", &ns]);
    assert!(
        !ok && err.contains("get upgradeplan/nope") && err.contains("not found"),
        "{err}"
    );

    // The default output is a table.
    let (ok, table, err) = kubectl(cp, &dir, &["steward", "status", "-n", &ns]);
    assert!(ok, "{err}");
    assert!(
        table.contains("UpgradePlans\nNAME    READY   PHASE       WAVE"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("gated") && l.contains("Succeeded")),
        "{table}"
    );

    orchestrator.stop().await.expect("orchestrator stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_what_the_operators_report_and_actions_write_what_they_watch() {
    let dir = plugin();
    let cp = control_plane().await;
    let ns = cp.namespace("plugin-status").await.expect("namespace");
    let client = cp.client().expect("client");
    let status = PatchParams::default();

    let clusters: Api<PostgresCluster> = Api::namespaced(client.clone(), &ns);
    let cluster: PostgresCluster = serde_json::from_value(json!({
        "apiVersion": "database.steward.dev/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": "pg"},
        "spec": {"instances": 3, "version": 17, "storage": {"size": "1Gi"}},
    }))
    .expect("cluster");
    clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create cluster");
    let instance = |name: &str, role: &str, lag: u64| json!({"name": name, "role": role, "timeline": 2, "lsn": "0/3000000", "replayLagBytes": lag, "ready": true});
    clusters
        .patch_status(
            "pg",
            &status,
            &Patch::Merge(json!({"status": {
                "phase": "Ready", "readyInstances": 3, "currentVersion": 17, "primary": "pg-0",
                "instances": [instance("pg-0", "primary", 0), instance("pg-1", "replica", 4096), instance("pg-2", "replica", 0)],
                "conditions": [{"type": "Ready", "status": "True", "reason": "AllInstancesReady", "message": "", "lastTransitionTime": "2026-12-01T10:00:00Z"}],
            }})),
        )
        .await
        .expect("cluster status");

    let roles: Api<DatabaseRole> = Api::namespaced(client.clone(), &ns);
    let role: DatabaseRole = serde_json::from_value(json!({
        "apiVersion": "database.steward.dev/v1alpha1",
        "kind": "DatabaseRole",
        "metadata": {"name": "reader"},
        "spec": {"databaseRef": {"name": "app"}, "roleName": "reader", "privileges": "readOnly"},
    }))
    .expect("role");
    roles
        .create(&PostParams::default(), &role)
        .await
        .expect("create role");

    // The tenant-operator's Lease, as its leader holds it.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "tenant-operator"},
        "spec": {"holderIdentity": "tenant-operator-5f7c9-x2x4z_8d1e", "leaseTransitions": 2,
                 "leaseDurationSeconds": 15, "renewTime": "2026-12-01T10:00:00.000000Z"},
    }))
    .expect("lease");
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create lease");

    let report = status_json(cp, &dir, &ns);
    let pg = &report["postgresClusters"][0];
    assert_eq!(
        (
            &pg["name"],
            &pg["ready"],
            &pg["primary"],
            &pg["maxLagBytes"],
            &pg["readyInstances"]
        ),
        (
            &json!("pg"),
            &json!("True"),
            &json!("pg-0"),
            &json!(4096),
            &json!(3)
        ),
        "{report:#}"
    );
    let reader = &report["databaseRoles"][0];
    assert_eq!(
        (&reader["name"], &reader["ready"], &reader["reason"]),
        (&json!("reader"), &json!("Unknown"), &json!("NotReported"))
    );
    let operator = report["operators"]
        .as_array()
        .expect("operators")
        .iter()
        .find(|o| o["namespace"] == ns.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("the Lease in {ns} is listed: {report:#}"));
    assert_eq!(
        (
            &operator["operator"],
            &operator["leader"],
            &operator["transitions"]
        ),
        (
            &json!("tenant-operator"),
            &json!("tenant-operator-5f7c9-x2x4z"),
            &json!(2)
        )
    );
    let (ok, yaml, err) = kubectl(cp, &dir, &["steward", "status", "-n", &ns, "-o", "yaml"]);
    assert!(ok, "{err}");
    let from_yaml: Value = serde_yaml::from_str(&yaml).expect("status -o yaml parses");
    assert_eq!(from_yaml["postgresClusters"], report["postgresClusters"]);

    // Switchover: to the most caught-up ready replica by default; the primary is refused.
    let (ok, _, err) = kubectl(
        cp,
        &dir,
        &["steward", "switchover", "pg", "--to", "pg-0", "-n", &ns],
    );
    assert!(!ok && err.contains("pg-0 is the primary already"), "{err}");
    let annotations = |c: PostgresCluster| c.metadata.annotations.unwrap_or_default();
    assert!(
        !annotations(clusters.get("pg").await.expect("get"))
            .contains_key(database_operator::cluster::SWITCHOVER_ANNOTATION),
        "a refused switchover writes nothing"
    );
    let (ok, out, err) = kubectl(cp, &dir, &["steward", "switchover", "pg", "-n", &ns]);
    assert!(ok, "switchover: {err}");
    assert!(out.contains("from pg-0 to pg-2"), "{out}");
    assert_eq!(
        annotations(clusters.get("pg").await.expect("get"))
            .get(database_operator::cluster::SWITCHOVER_ANNOTATION),
        Some(&"pg-2".to_string())
    );

    // Backup: refused without spec.backup (nothing created), else a PostgresBackup named
    // as asked.
    let backups: Api<database_operator::PostgresBackup> = Api::namespaced(client.clone(), &ns);
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "backup", "pg", "-n", &ns]);
    assert!(!ok && err.contains("no spec.backup"), "{err}");
    assert!(
        backups
            .list(&Default::default())
            .await
            .expect("list")
            .items
            .is_empty()
    );
    clusters
        .patch(
            "pg",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"backup": {"objectStore": {
                "endpoint": "http://s3.example:9000", "bucket": "backups", "path": "pg",
                "credentialsSecret": "s3"}}}})),
        )
        .await
        .expect("spec.backup");
    let (ok, out, err) = kubectl(
        cp,
        &dir,
        &[
            "steward",
            "backup",
            "pg",
            "--name",
            "before-migration",
            "-n",
            &ns,
        ],
    );
    assert!(ok, "backup: {err}");
    assert!(out.contains("postgresbackup/before-migration"), "{out}");
    let backup = backups.get("before-migration").await.expect("created");
    assert_eq!(backup.spec.cluster, "pg");

    // Rotate: a new value of the annotation each time (the operator rotates once per value).
    let rotation = || async {
        roles
            .get("reader")
            .await
            .expect("get role")
            .metadata
            .annotations
            .unwrap_or_default()
            .get(database_operator::crd::ROTATE_ANNOTATION)
            .cloned()
    };
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "rotate", "reader", "-n", &ns]);
    assert!(ok, "rotate: {err}");
    let first = rotation().await.expect("rotation annotation set");
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "rotate", "reader", "-n", &ns]);
    assert!(ok, "rotate again: {err}");
    assert_ne!(
        rotation().await.expect("set"),
        first,
        "a second rotation is a new request"
    );

    // logs finds the leader through the Lease; here its pod does not exist.
    let (ok, _, err) = kubectl(cp, &dir, &["steward", "logs", "tenant-operator", "-n", &ns]);
    assert!(
        !ok && err.contains("tenant-operator-5f7c9-x2x4z") && err.contains("not found"),
        "{err}"
    );

    // Completions are generated for the binary kubectl runs.
    let out = Command::new(dir.join("kubectl-steward"))
        .args(["completions", "bash"])
        .output()
        .expect("completions");
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && script.contains("kubectl-steward"),
        "{script}"
    );
    assert!(
        script.contains("switchover"),
        "completion offers the subcommands"
    );
}
