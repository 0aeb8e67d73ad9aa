//! The whole agent ([`agent::run`]) against testenv's control plane, a real PgBouncer and a
//! real PostgreSQL, driven by a planned switchover as the instance managers perform it: the
//! Lease's pause annotation, then the holder moved and the annotation lifted.
//!
//! The instance pods are API objects only (no node runs them): their status (the pod IP, both
//! 127.0.0.1, where PostgreSQL listens) and their published roles are written by the test.
//!
//! Invariants: the pause is acknowledged only after the open transaction committed; a query
//! sent while paused waits in PgBouncer and runs after the switchover; the acknowledgement
//! goes when the pause is lifted; a `PAUSE` held up past `AGENT_PAUSE_WAIT` is undone and never
//! acknowledged; the agent stops PgBouncer and returns `Ok` on shutdown.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use steward_pooler::agent::{self, Settings};
use steward_pooler::config::{self, PoolMode};
use steward_pooler::contract::{self, pooler};
use steward_testenv::{ControlPlane, Options};
use support::{APP_PASSWORD, AUTH_PASSWORD, connect, give_to_pgbouncer, one_value, wait_for};
use tokio_util::sync::CancellationToken;

const NAMESPACE: &str = "pooler-agent";
const CLUSTER: &str = "pg";
const POD: &str = "pg-pooler-0";

fn status(role: &str) -> String {
    format!(r#"{{"role":"{role}","timeline":1,"lsn":"0/3000060","replayLag":0}}"#)
}

async fn publish(pods: &Api<Pod>, name: &str, role: &str) {
    pods.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(
            json!({"metadata": {"annotations": {contract::STATUS_ANNOTATION: status(role)}}}),
        ),
    )
    .await
    .expect("publish the instance status");
}

async fn metrics() -> String {
    let addr = SocketAddr::from(([127, 0, 0, 1], pooler::HTTP_PORT));
    steward_testenv::http_get(addr, "/metrics")
        .await
        .map(|(_, body)| body)
        .unwrap_or_default()
}

async fn ack(config_maps: &Api<ConfigMap>) -> Option<String> {
    let map = config_maps
        .get(&pooler::state_config_map(CLUSTER))
        .await
        .ok()?;
    map.data?.get(POD).cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_switchover_pauses_acknowledges_and_resumes_on_the_new_primary() {
    let Some((program, pg, _superuser)) = support::prerequisites().await else {
        return;
    };
    let cp = ControlPlane::start(Options {
        nodes: 0,
        ..Options::default()
    })
    .await
    .expect("control plane");
    let client = cp.client().expect("client");
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).expect("namespace"),
        )
        .await
        .expect("namespace");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    config_maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": pooler::state_config_map(CLUSTER)}}),
            )
            .expect("ConfigMap"),
        )
        .await
        .expect("the state ConfigMap");
    for (name, role) in [("pg-0", "primary"), ("pg-1", "replica")] {
        let pod = json!({
            "metadata": {
                "name": name,
                "labels": {contract::CLUSTER_LABEL: CLUSTER},
                "annotations": {contract::STATUS_ANNOTATION: status(role)},
            },
            "spec": {"nodeName": "nowhere", "containers": [{"name": "postgres", "image": "postgres"}]},
        });
        pods.create(
            &PostParams::default(),
            &serde_json::from_value(pod).expect("pod"),
        )
        .await
        .expect("pod");
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}),
            ),
        )
        .await
        .expect("pod IP");
    }
    let lease = json!({
        "metadata": {"name": contract::lease_name(CLUSTER)},
        "spec": {"holderIdentity": "pg-0", "leaseDurationSeconds": 10},
    });
    leases
        .create(
            &PostParams::default(),
            &serde_json::from_value(lease).expect("Lease"),
        )
        .await
        .expect("Lease");

    let dir = tempfile::Builder::new()
        .prefix("steward-pooler-agent-")
        .tempdir()
        .expect("temp dir");
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).expect("run dir");
    give_to_pgbouncer(&run_dir);
    let password_file = dir.path().join("password");
    std::fs::write(&password_file, format!("{AUTH_PASSWORD}\n")).expect("password file");
    let port = steward_testenv::free_port().expect("a free port");
    let files = config::Settings {
        listen_addr: "127.0.0.1".into(),
        listen_port: port,
        server_port: pg.port(),
        run_dir: run_dir.clone(),
        pool_mode: PoolMode::Transaction,
        default_pool_size: 5,
        max_client_conn: 50,
        tls: None,
    };
    let settings = Settings {
        cluster: CLUSTER.into(),
        namespace: NAMESPACE.into(),
        pod: POD.into(),
        program: support::pgbouncer_program(dir.path(), &program, &files.auth_file_path()),
        pgbouncer: files,
        auth_password_file: password_file,
        grace: Duration::from_secs(10),
    };
    let shutdown = CancellationToken::new();
    let agent = tokio::spawn(agent::run(settings, client.clone(), shutdown.clone()));

    // Ready: the console answers and PgBouncer points at pg-0.
    let ready = Instant::now();
    wait_for("the agent is ready", Duration::from_secs(20), || async {
        let addr = SocketAddr::from(([127, 0, 0, 1], pooler::HTTP_PORT));
        let (code, _) = steward_testenv::http_get(addr, "/readyz").await.ok()?;
        (code == 200).then_some(())
    })
    .await;
    eprintln!("ready after {:?}", ready.elapsed());
    let ini = std::fs::read_to_string(run_dir.join(config::INI_FILE)).expect("ini");
    assert!(ini.contains("* = host=127.0.0.1 port="), "{ini}");
    let app = connect(port, "app", APP_PASSWORD)
        .await
        .expect("app logs in through the agent's PgBouncer");
    assert_eq!(one_value(&app, "SELECT current_user").await, "app");

    // The primary asks for a pause while a transaction is open.
    app.batch_execute("BEGIN; SELECT 1").await.expect("BEGIN");
    let pause = "pg-1/1700000000000";
    leases
        .patch(
            &contract::lease_name(CLUSTER),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {pooler::PAUSE_ANNOTATION: pause}}})),
        )
        .await
        .expect("ask for the pause");
    // The agent sees the annotation within moments (a watch); its PAUSE then waits for the
    // COMMIT. Two seconds without an acknowledgement are many turns of the agent's loop.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        ack(&config_maps).await,
        None,
        "acknowledged with a transaction open"
    );
    app.batch_execute("COMMIT").await.expect("COMMIT");
    let paused = Instant::now();
    wait_for(
        "the pause acknowledged",
        Duration::from_secs(10),
        || async { (ack(&config_maps).await.as_deref() == Some(pause)).then_some(()) },
    )
    .await;
    eprintln!("acknowledged {:?} after the COMMIT", paused.elapsed());
    let managers: Vec<String> = config_maps
        .get(&pooler::state_config_map(CLUSTER))
        .await
        .expect("ConfigMap")
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers
            .iter()
            .any(|m| m == &format!("steward-pooler/{POD}")),
        "{managers:?}"
    );

    // Paused: the next transaction waits in PgBouncer.
    let waiting = tokio::spawn(async move {
        let value = one_value(&app, "SELECT 2").await;
        (app, value)
    });
    wait_for(
        "the query waits in PgBouncer",
        Duration::from_secs(10),
        || async {
            let text = metrics().await;
            (text
                .contains(r#"steward_pgbouncer_clients_waiting{database="postgres",user="app"} 1"#)
                && text.lines().any(|l| l == "steward_pooler_paused 1"))
            .then_some(())
        },
    )
    .await;

    // The switchover: pg-1 promoted, takes the Lease, lifts the pause.
    publish(&pods, "pg-0", "replica").await;
    publish(&pods, "pg-1", "primary").await;
    leases
        .patch(
            &contract::lease_name(CLUSTER),
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {pooler::PAUSE_ANNOTATION: null}},
                "spec": {"holderIdentity": "pg-1"},
            })),
        )
        .await
        .expect("lift the pause");
    let (app, value) = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting query runs after the switchover")
        .expect("the query task");
    assert_eq!(value, "2");
    wait_for(
        "the acknowledgement removed",
        Duration::from_secs(10),
        || async { ack(&config_maps).await.is_none().then_some(()) },
    )
    .await;
    // The agent's figures (a scrape is served again for a second: wait for a fresh one).
    let expected = [
        "steward_pooler_up 1",
        "steward_pooler_paused 0",
        "steward_pooler_pauses_total 1",
        "steward_pooler_primary_changes_total 2",
    ];
    wait_for("the resumed figures", Duration::from_secs(5), || async {
        let text = metrics().await;
        expected
            .iter()
            .all(|line| text.lines().any(|l| l == *line))
            .then_some(())
    })
    .await;
    assert_eq!(one_value(&app, "SELECT 3").await, "3");

    // A pause whose PAUSE cannot finish (a transaction held past AGENT_PAUSE_WAIT): the agent
    // resumes on a fresh console session, never acknowledges it, and does not pause for it
    // again.
    let holder = connect(port, "app", APP_PASSWORD)
        .await
        .expect("second client");
    holder
        .batch_execute("BEGIN; SELECT 1")
        .await
        .expect("BEGIN");
    let stuck = "pg-0/1700000000001";
    leases
        .patch(
            &contract::lease_name(CLUSTER),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {pooler::PAUSE_ANNOTATION: stuck}}})),
        )
        .await
        .expect("ask for a pause");
    let asked = Instant::now();
    let waiting = tokio::spawn(async move {
        let value = one_value(&app, "SELECT 4").await;
        (app, value)
    });
    wait_for(
        "the query waits behind the pending PAUSE",
        Duration::from_secs(10),
        || async {
            metrics()
                .await
                .contains(r#"steward_pgbouncer_clients_waiting{database="postgres",user="app"} 1"#)
                .then_some(())
        },
    )
    .await;
    let bound = pooler::AGENT_PAUSE_WAIT;
    let (app, value) = tokio::time::timeout(bound + Duration::from_secs(10), waiting)
        .await
        .expect("the agent resumes once AGENT_PAUSE_WAIT passed")
        .expect("the query task");
    assert_eq!(value, "4");
    assert!(
        asked.elapsed() >= bound,
        "resumed after {:?}, before AGENT_PAUSE_WAIT",
        asked.elapsed()
    );
    assert_eq!(
        ack(&config_maps).await,
        None,
        "a pause that never finished was acknowledged"
    );
    holder.batch_execute("COMMIT").await.expect("COMMIT");
    assert_eq!(one_value(&app, "SELECT 5").await, "5", "not paused again");
    let text = metrics().await;
    assert!(
        text.lines().any(|l| l == "steward_pooler_pauses_total 1"),
        "the failed PAUSE counted as a pause:\n{text}"
    );

    // Shutdown: PgBouncer stopped safely, the agent returns Ok.
    drop(app);
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), agent)
        .await
        .expect("the agent stops within the grace")
        .expect("the agent task")
        .expect("the agent ends without error");
}
