//! tenant-operator against a real control plane: what a Tenant creates and how it converges,
//! what its owners can and cannot do (acting as them by impersonation), the tenant-wide quota,
//! deletion policies, 100 tenants with a write-free resync, and admission of bad input.
//!
//! Each test runs its own in-process operator limited to its own Tenants by a label selector,
//! so tests run concurrently on the shared control plane; the scale test runs alone (it counts
//! the API server's writes).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, LimitRange, Namespace, Pod, PodSpec, ResourceQuota, ResourceRequirements,
    ScopeSelector, ScopedResourceSelectorRequirement, Secret,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::{Value, json};
use steward_core::Operator;
use steward_testenv::harness::{Harness, test_args};
use steward_testenv::{ControlPlane, eventually};
use tenant_operator::crd::{
    ADMITTED_LABEL, NamedQuota, NamespaceDeletionPolicy, PodSecurityLevel, PullPolicy,
    QUOTA_EXCEEDED, ServiceType, SharedKind, SubjectKind, TENANT_LABEL, Tenant, TenantPhase,
    TenantPolicies,
};
use tenant_operator::{NAME, Options};

#[path = "support/fixtures.rs"]
mod fixtures;
use fixtures::TenantBuilder;

const WAIT: Duration = Duration::from_secs(90);
const TEST_LABEL: &str = "steward.dev/test";

/// Tests share the control plane; the scale test counts the API server's writes, so it runs
/// alone (write lock) while the others may run together (read lock).
static EXCLUSIVE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn suffix() -> String {
    format!("{:05x}", rand_u32() & 0xfffff)
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id()));
    h.finish() as u32
}

/// The operator, in-process, for the Tenants labelled `steward.dev/test=<id>`, reconciling
/// every Tenant again each `resync`.
async fn start_operator(cp: &ControlPlane, id: &str, resync: Duration) -> Harness {
    let mut operator = Operator::with_config(NAME, test_args(), cp.config().clone())
        .expect("operator")
        .backoff(Duration::from_millis(200), Duration::from_secs(5));
    let options = Options {
        tenant_selector: Some(format!("{TEST_LABEL}={id}")),
        resync_period: resync,
        shared_namespaces: vec![shared_namespace(id)],
        ..Options::default()
    };
    tenant_operator::register(&mut operator, options).expect("register");
    Harness::start(operator).await
}

/// What the operator's access Role grants, as `(resource, name)` pairs, sorted.
fn access_names(role: &Role) -> Vec<(&str, &str)> {
    let mut names: Vec<(&str, &str)> = role
        .rules
        .iter()
        .flatten()
        .flat_map(|r| {
            let resource = r
                .resources
                .as_ref()
                .and_then(|r| r.first())
                .map_or("", String::as_str);
            r.resource_names
                .iter()
                .flatten()
                .map(move |n| (resource, n.as_str()))
        })
        .collect();
    names.sort();
    names
}

/// The namespace the operator of test `id` shares sources from (created by
/// [`Env::shared_namespace`]).
fn shared_namespace(id: &str) -> String {
    format!("{id}-src")
}

/// One test's world: the control plane, an admin client, the Tenant API and the operator.
struct Env {
    cp: &'static ControlPlane,
    client: Client,
    tenants: Api<Tenant>,
    id: String,
    operator: Option<Harness>,
}

impl Env {
    async fn start(prefix: &str) -> Env {
        let cp = steward_testenv::shared().await.expect("control plane");
        cp.apply_crd(&Tenant::crd()).await.expect("Tenant CRD");
        let client = cp.client().expect("client");
        let id = format!("{prefix}-{}", suffix());
        let operator = Some(start_operator(cp, &id, Duration::from_secs(3600)).await);
        Env {
            cp,
            tenants: Api::all(client.clone()),
            client,
            id,
            operator,
        }
    }

    /// Creates the namespace this test's operator shares sources from.
    async fn shared_namespace(&self) -> String {
        let name = shared_namespace(&self.id);
        let ns = fixtures::namespace(&name);
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("source namespace");
        name
    }

    fn operator(&self) -> &Harness {
        self.operator.as_ref().expect("running")
    }

    async fn stop(&mut self) {
        if let Some(op) = self.operator.take() {
            op.stop().await.expect("clean shutdown");
        }
    }

    /// Creates the Tenant `tenant` builds, labelled for this test's operator.
    async fn create(&self, tenant: TenantBuilder) -> Tenant {
        let t = tenant.label(TEST_LABEL, &self.id).build();
        self.tenants
            .create(&PostParams::default(), &t)
            .await
            .expect("create Tenant")
    }

    async fn patch_spec(&self, name: &str, spec: Value) {
        self.tenants
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": spec})),
            )
            .await
            .expect("patch Tenant");
    }

    /// Waits until Tenant `name` is Ready for its current generation.
    async fn ready(&self, name: &str) -> Tenant {
        let api = self.tenants.clone();
        eventually(&format!("Tenant {name} Ready"), WAIT, || {
            let api = api.clone();
            async move {
                let t = api.get(name).await.map_err(|e| e.to_string())?;
                let status = t.status.clone().unwrap_or_default();
                let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
                match ready {
                    Some(c)
                        if c.status == "True"
                            && status.observed_generation == t.metadata.generation =>
                    {
                        Ok(t)
                    }
                    Some(c) => Err(format!(
                        "Ready={} {}: {} (observed {:?} of {:?})",
                        c.status,
                        c.reason,
                        c.message,
                        status.observed_generation,
                        t.metadata.generation
                    )),
                    None => Err("no Ready condition yet".into()),
                }
            }
        })
        .await
        .expect("Tenant Ready")
    }

    fn api<K>(&self, ns: &str) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), ns)
    }

    /// A client acting as `user` (impersonated; in `system:authenticated`).
    fn as_user(&self, user: &str) -> Client {
        self.cp
            .impersonating_client(user, &[])
            .expect("impersonating client")
    }

    /// Waits until Tenant `name` is gone *and* the garbage collector has removed its
    /// cluster-scoped children, so their deletion does not land in another test's count of
    /// API server writes.
    async fn tenant_gone(&self, name: &str) {
        self.gone(&self.tenants, name).await;
        let selector = format!("{TENANT_LABEL}={name}");
        let roles: Api<ClusterRole> = Api::all(self.client.clone());
        let bindings: Api<ClusterRoleBinding> = Api::all(self.client.clone());
        eventually(
            &format!("{name}'s cluster roles collected"),
            WAIT,
            || async {
                let lp = ListParams::default().labels(&selector);
                let left = roles
                    .list(&lp)
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .len()
                    + bindings
                        .list(&lp)
                        .await
                        .map_err(|e| e.to_string())?
                        .items
                        .len();
                if left == 0 {
                    Ok(())
                } else {
                    Err(format!("{left} left"))
                }
            },
        )
        .await
        .expect("collected");
    }

    async fn gone<K>(&self, api: &Api<K>, name: &str)
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        eventually(&format!("{name} gone"), WAIT, || async {
            match api.get_opt(name).await {
                Ok(None) => Ok(()),
                Ok(Some(_)) => Err("still there".to_string()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .expect("gone");
    }
}

fn code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn configmap(name: &str, extra_labels: &[(&str, &str)], data: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels(extra_labels)),
            ..Default::default()
        },
        data: Some(labels(data)),
        ..Default::default()
    }
}

fn pod(name: &str) -> Pod {
    fixtures::pod(
        name,
        fixtures::pod_spec([fixtures::container("app", "registry.k8s.io/pause:3.10")]),
    )
}

fn namespace(name: &str, tenant: Option<&str>) -> Namespace {
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.into());
    ns.metadata.labels = tenant.map(|t| labels(&[(TENANT_LABEL, t)]));
    ns
}

/// Retries a dry-run `probe` until the API server denies it with a message containing
/// `needle` (admission policies take a moment to load), returning that message.
async fn denied_eventually<F, Fut, T>(what: &str, needle: &str, probe: F) -> String
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    eventually(what, WAIT, || async {
        match probe().await {
            Ok(_) => Err("allowed".to_string()),
            Err(e) if code(&e) == Some(403) && e.to_string().contains(needle) => Ok(e.to_string()),
            Err(e) => Err(format!("unexpected error: {e}")),
        }
    })
    .await
    .expect("denied")
}

fn dry_delete() -> DeleteParams {
    DeleteParams {
        dry_run: true,
        ..Default::default()
    }
}

fn dry_post() -> PostParams {
    PostParams {
        dry_run: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_creates_its_objects_and_converges_on_spec_changes() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("conv").await;
    let t = env.id.clone();
    let owner = format!("alice-{t}");

    // Shared sources, opted in by label.
    let src = env.shared_namespace().await;
    let secret = Secret {
        metadata: fixtures::labelled("registry", [("tenancy.steward.dev/shareable", "true")]),
        ..fixtures::secret("registry", [("token", "s3cret")])
    };
    env.api::<Secret>(&src)
        .create(&PostParams::default(), &secret)
        .await
        .expect("source secret");
    env.api::<ConfigMap>(&src)
        .create(
            &PostParams::default(),
            &configmap(
                "ca-bundle",
                &[("tenancy.steward.dev/shareable", "true")],
                &[("ca.crt", "CERT")],
            ),
        )
        .await
        .expect("source configmap");

    let (a, b, c) = (format!("{t}-a"), format!("{t}-b"), format!("{t}-c"));
    let started = Instant::now();
    let created = env
        .create(
            fixtures::tenant(&t)
                .owner_user(&owner)
                .namespaces([&a, &b])
                .deletion_policy(NamespaceDeletionPolicy::Delete)
                .pod_security(PodSecurityLevel::Baseline)
                .namespace_metadata(
                    [("team", t.as_str()), ("cost-center", "42")],
                    [("contact", "team@example.com")],
                )
                .resource_quota([("pods", "5"), ("requests.cpu", "2")])
                .container_limits(
                    [("cpu", "200m"), ("memory", "128Mi")],
                    [("cpu", "100m"), ("memory", "64Mi")],
                )
                .allow_from_namespaces(["monitoring"])
                .shared(SharedKind::Secret, &src, "registry")
                .shared(SharedKind::ConfigMap, &src, "ca-bundle")
                .role_binding(
                    "view",
                    vec![fixtures::tenant_subject(SubjectKind::Group, "auditors")],
                ),
        )
        .await;
    let uid = created.uid().unwrap();
    let tenant = env.ready(&t).await;
    println!(
        "tenant with 2 namespaces Ready after {:?}",
        started.elapsed()
    );
    let status = tenant.status.clone().unwrap();
    assert_eq!(status.namespaces, [a.clone(), b.clone()]);
    assert_eq!(status.namespace_count, 2);
    assert_eq!(status.phase, Some(TenantPhase::Active));
    assert!(
        tenant
            .finalizers()
            .iter()
            .any(|f| f == "tenancy.steward.dev/namespaces")
    );

    for ns in [&a, &b] {
        let n = Api::<Namespace>::all(env.client.clone())
            .get(ns)
            .await
            .expect("namespace");
        let l = n.labels();
        assert_eq!(l[TENANT_LABEL], t);
        assert_eq!(l["pod-security.kubernetes.io/enforce"], "baseline");
        assert_eq!(l["team"], t);
        assert_eq!(l["cost-center"], "42");
        assert_eq!(n.annotations()["contact"], "team@example.com");

        let rq = env
            .api::<ResourceQuota>(ns)
            .get("tenant-quota")
            .await
            .expect("ResourceQuota");
        let hard = rq.spec.clone().unwrap().hard.unwrap();
        assert_eq!(hard["pods"].0, "5");
        assert_eq!(hard["requests.cpu"].0, "2");
        assert_eq!(rq.labels()["steward.dev/owner-uid"], uid);
        assert_eq!(
            rq.owner_references()[0].uid,
            uid,
            "children are owned by the Tenant"
        );

        let lr = env
            .api::<LimitRange>(ns)
            .get("tenant-limits")
            .await
            .expect("LimitRange");
        assert_eq!(
            lr.spec.unwrap().limits[0].default.as_ref().unwrap()["cpu"].0,
            "200m"
        );

        let np = env
            .api::<NetworkPolicy>(ns)
            .get("tenant-isolation")
            .await
            .expect("NetworkPolicy");
        let from = np.spec.unwrap().ingress.unwrap()[0].from.clone().unwrap();
        assert_eq!(
            from[0]
                .namespace_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap()[TENANT_LABEL],
            t
        );
        assert_eq!(
            from[1]
                .namespace_selector
                .as_ref()
                .unwrap()
                .match_expressions
                .as_ref()
                .unwrap()[0]
                .values
                .as_deref(),
            Some(&["monitoring".to_string()][..])
        );

        let owners = env
            .api::<RoleBinding>(ns)
            .get("tenant-owner-admin")
            .await
            .expect("owner RoleBinding");
        assert_eq!(owners.role_ref.name, "admin");
        assert_eq!(owners.subjects.unwrap()[0].name, owner);
        let view = env
            .api::<RoleBinding>(ns)
            .get("tenant-view")
            .await
            .expect("view RoleBinding");
        assert_eq!(view.subjects.unwrap()[0].name, "auditors");

        let copy = env
            .api::<Secret>(ns)
            .get("registry")
            .await
            .expect("shared Secret");
        assert_eq!(copy.data.clone().unwrap()["token"].0, b"s3cret");
        assert_eq!(
            copy.annotations()["tenancy.steward.dev/source"],
            format!("{src}/registry")
        );
        let cm = env
            .api::<ConfigMap>(ns)
            .get("ca-bundle")
            .await
            .expect("shared ConfigMap");
        assert_eq!(cm.data.unwrap()["ca.crt"], "CERT");
        // The operator reaches the copies by name only, through its own Role here.
        let access = env
            .api::<Role>(ns)
            .get("tenancy.steward.dev:tenant-operator")
            .await
            .expect("the operator's access Role");
        assert_eq!(
            access_names(&access),
            [
                ("configmaps", "ca-bundle"),
                ("configmaps", "tenancy.steward.dev-policies"),
                ("secrets", "registry")
            ]
        );
    }
    let role = Api::<ClusterRole>::all(env.client.clone())
        .get(&format!("tenancy.steward.dev:owner:{t}"))
        .await
        .expect("ClusterRole");
    assert!(role.rules.unwrap()[0].verbs.contains(&"own".to_string()));
    let crb = Api::<ClusterRoleBinding>::all(env.client.clone())
        .get(&format!("tenancy.steward.dev:owner:{t}"))
        .await
        .expect("CRB");
    assert_eq!(crb.subjects.unwrap()[0].name, owner);

    // Change the spec: add c, remove b (Delete), raise the pods quota, drop a label and the
    // shared ConfigMap.
    env.patch_spec(
        &t,
        json!({
            "namespaces": [a, c],
            "resourceQuota": {"hard": {"pods": 7, "requests.cpu": "2"}},
            "namespaceMetadata": {"labels": {"team": t, "cost-center": null}},
            "sharedObjects": [{"kind": "Secret", "namespace": src, "name": "registry"}],
        }),
    )
    .await;
    let changed = Instant::now();
    let tenant = env.ready(&t).await;
    assert_eq!(
        tenant.status.clone().unwrap().namespaces,
        [a.clone(), c.clone()]
    );
    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    env.gone(&namespaces, &b).await;
    println!(
        "removed namespace {b} really gone {:?} after the spec change",
        changed.elapsed()
    );
    for kind_check in [
        env.api::<ResourceQuota>(&c)
            .get("tenant-quota")
            .await
            .map(|_| ()),
        env.api::<RoleBinding>(&c)
            .get("tenant-owner-admin")
            .await
            .map(|_| ()),
        env.api::<NetworkPolicy>(&c)
            .get("tenant-isolation")
            .await
            .map(|_| ()),
        env.api::<Secret>(&c).get("registry").await.map(|_| ()),
    ] {
        kind_check.expect("the added namespace has its objects");
    }
    let rq = env
        .api::<ResourceQuota>(&a)
        .get("tenant-quota")
        .await
        .unwrap();
    assert_eq!(
        rq.spec.unwrap().hard.unwrap()["pods"].0,
        "7",
        "quota change converged"
    );
    let ns_a = namespaces.get(&a).await.unwrap();
    assert!(
        !ns_a.labels().contains_key("cost-center"),
        "a label dropped from the spec is removed"
    );
    assert_eq!(ns_a.labels()["team"], t);
    env.gone(&env.api::<ConfigMap>(&a), "ca-bundle").await;
    let roles = env.api::<Role>(&a);
    eventually(
        "the access Role narrowed to the Secret (and the parameters)",
        WAIT,
        || async {
            let access = roles
                .get("tenancy.steward.dev:tenant-operator")
                .await
                .map_err(|e| e.to_string())?;
            match access_names(&access) {
                names
                    if names
                        == [
                            ("configmaps", "tenancy.steward.dev-policies"),
                            ("secrets", "registry"),
                        ] =>
                {
                    Ok(())
                }
                names => Err(format!("{names:?}")),
            }
        },
    )
    .await
    .unwrap();

    // A source outside the shared namespaces is never read: refused, with the reason.
    env.patch_spec(
        &t,
        json!({"sharedObjects": [{"kind": "Secret", "namespace": src, "name": "registry"},
                                 {"kind": "Secret", "namespace": "kube-system", "name": "anything"}]}),
    )
    .await;
    eventually("the kube-system source refused", WAIT, || async {
        let tenant = env.tenants.get(&t).await.map_err(|e| e.to_string())?;
        let status = tenant.status.unwrap_or_default();
        match status.conditions.iter().find(|c| c.type_ == "Ready") {
            Some(c)
                if c.reason == "SharedNamespaceNotAllowed"
                    && c.message.contains("Secret kube-system/anything")
                    && c.message.contains(&src) =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .unwrap();
    assert!(
        env.api::<Secret>(&a)
            .get_opt("anything")
            .await
            .unwrap()
            .is_none(),
        "nothing copied from kube-system"
    );
    env.patch_spec(
        &t,
        json!({"sharedObjects": [{"kind": "Secret", "namespace": src, "name": "registry"}]}),
    )
    .await;
    env.ready(&t).await;

    // A changed source reaches every copy.
    env.api::<Secret>(&src)
        .patch(
            "registry",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"token": "rotated"}})),
        )
        .await
        .expect("rotate source");
    for ns in [&a, &c] {
        let api = env.api::<Secret>(ns);
        eventually(&format!("copy in {ns} rotated"), WAIT, || async {
            let s = api.get("registry").await.map_err(|e| e.to_string())?;
            if s.data.unwrap_or_default()["token"].0 == b"rotated" {
                Ok(())
            } else {
                Err("old data".into())
            }
        })
        .await
        .expect("copy follows source");
    }
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_act_in_their_tenant_only_and_cannot_touch_its_guard_rails() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("own").await;
    let (ta, tb) = (format!("{}-a", env.id), format!("{}-b", env.id));
    let (alice, bob) = (format!("alice-{}", env.id), format!("bob-{}", env.id));
    let (a1, b1) = (format!("{ta}-1"), format!("{tb}-1"));

    // Give alice, through the Tenant, RBAC rights that the admission policies must still
    // override: delete/update quotas, limit ranges and network policies.
    let editor = format!("{}-guard-rail-editor", env.id);
    let verbs = ["get", "list", "update", "patch", "delete"];
    let role = fixtures::cluster_role(
        &editor,
        vec![
            fixtures::rule(&[""], &["resourcequotas", "limitranges"], &verbs),
            fixtures::rule(&["networking.k8s.io"], &["networkpolicies"], &verbs),
        ],
    );
    Api::<ClusterRole>::all(env.client.clone())
        .create(&PostParams::default(), &role)
        .await
        .expect("editor role");

    env.create(
        fixtures::tenant(&ta)
            .owner_user(&alice)
            .namespaces([&a1])
            .max_namespaces(2)
            .pod_security(PodSecurityLevel::Baseline)
            .resource_quota([("pods", "2")])
            .container_limits([], [("cpu", "10m"), ("memory", "16Mi")])
            .role_binding(
                &editor,
                vec![fixtures::tenant_subject(SubjectKind::User, &alice)],
            ),
    )
    .await;
    env.create(fixtures::tenant(&tb).owner_user(&bob).namespaces([&b1]))
        .await;
    env.ready(&ta).await;
    env.ready(&tb).await;
    let as_alice = env.as_user(&alice);

    // In her own namespace alice can deploy.
    let deployment = fixtures::deployment(
        "web",
        1,
        fixtures::pod_spec([fixtures::container("web", "registry.k8s.io/pause:3.10")]),
    );
    let deployments: Api<Deployment> = Api::namespaced(as_alice.clone(), &a1);
    eventually(
        "alice may create a Deployment in her namespace",
        WAIT,
        || async {
            deployments
                .create(&PostParams::default(), &deployment)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await
    .expect("alice deploys");

    // She can see her namespace by name (kubectl get namespace), not B's, and not list them all.
    let ns_api: Api<Namespace> = Api::all(as_alice.clone());
    eventually("alice gets her namespace", WAIT, || async {
        ns_api.get(&a1).await.map(drop).map_err(|e| e.to_string())
    })
    .await
    .unwrap();
    let err = ns_api.get(&b1).await.expect_err("get B's namespace");
    assert_eq!(code(&err), Some(403), "{err}");
    let err = ns_api
        .list(&ListParams::default())
        .await
        .expect_err("list every namespace");
    assert_eq!(code(&err), Some(403), "{err}");

    // Nothing of tenant B is visible to her.
    let err = Api::<Pod>::namespaced(as_alice.clone(), &b1)
        .list(&ListParams::default())
        .await
        .expect_err("list pods in B");
    assert_eq!(code(&err), Some(403), "{err}");
    let err = Api::<ConfigMap>::namespaced(as_alice.clone(), &b1)
        .get("kube-root-ca.crt")
        .await
        .expect_err("read configmap in B");
    assert_eq!(code(&err), Some(403), "{err}");
    let err = Api::<Secret>::namespaced(as_alice.clone(), &b1)
        .list(&ListParams::default())
        .await
        .expect_err("list secrets in B");
    assert_eq!(code(&err), Some(403), "{err}");
    Api::<Pod>::namespaced(as_alice.clone(), &a1)
        .list(&ListParams::default())
        .await
        .expect("list pods in A");

    // RBAC would let her delete the guard rails; the admission policy does not.
    let quotas: Api<ResourceQuota> = Api::namespaced(as_alice.clone(), &a1);
    let msg = denied_eventually(
        "deleting the quota denied",
        "ValidatingAdmissionPolicy",
        || async { quotas.delete("tenant-quota", &dry_delete()).await },
    )
    .await;
    assert!(
        msg.contains("tenancy.steward.dev-managed-objects")
            && msg.contains("is managed by tenant-operator"),
        "{msg}"
    );
    let err = quotas
        .delete("tenant-quota", &DeleteParams::default())
        .await
        .expect_err("delete quota");
    assert_eq!(code(&err), Some(403), "{err}");
    let err = quotas
        .patch(
            "tenant-quota",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"hard": {"pods": "100"}}})),
        )
        .await
        .expect_err("raise own quota");
    assert!(
        err.to_string().contains("ValidatingAdmissionPolicy"),
        "{err}"
    );
    let err = Api::<NetworkPolicy>::namespaced(as_alice.clone(), &a1)
        .delete("tenant-isolation", &DeleteParams::default())
        .await
        .expect_err("delete network policy");
    assert!(
        code(&err) == Some(403)
            && err
                .to_string()
                .contains("tenancy.steward.dev-managed-objects"),
        "{err}"
    );
    let err = Api::<RoleBinding>::namespaced(as_alice.clone(), &a1)
        .delete("tenant-owner-admin", &DeleteParams::default())
        .await
        .expect_err("delete own RoleBinding");
    assert!(
        code(&err) == Some(403) && err.to_string().contains("ValidatingAdmissionPolicy"),
        "{err}"
    );
    // ...while her own objects are hers to delete.
    let mine: Api<ConfigMap> = Api::namespaced(as_alice.clone(), &a1);
    mine.create(
        &PostParams::default(),
        &configmap("mine", &[], &[("k", "v")]),
    )
    .await
    .expect("own configmap");
    mine.delete("mine", &DeleteParams::default())
        .await
        .expect("delete own configmap");
    assert!(
        env.api::<ResourceQuota>(&a1)
            .get_opt("tenant-quota")
            .await
            .unwrap()
            .is_some(),
        "quota still there"
    );

    // She cannot exceed her quota (pods: 2, the Deployment's pod included).
    let pods: Api<Pod> = Api::namespaced(as_alice.clone(), &a1);
    let rq_api = env.api::<ResourceQuota>(&a1);
    eventually("quota usage known", WAIT, || async {
        let rq = rq_api
            .get("tenant-quota")
            .await
            .map_err(|e| e.to_string())?;
        let used = rq.status.and_then(|s| s.used).unwrap_or_default();
        if used.contains_key("pods") {
            Ok(())
        } else {
            Err("status.used has no pods yet".into())
        }
    })
    .await
    .unwrap();
    let mut denied = Vec::new();
    for i in 0..4 {
        if let Err(e) = pods
            .create(&PostParams::default(), &pod(&format!("p{i}")))
            .await
        {
            assert_eq!(code(&e), Some(403), "{e}");
            denied.push(e.to_string());
        }
    }
    assert!(
        !denied.is_empty() && denied.iter().all(|m| m.contains("exceeded quota")),
        "{denied:?}"
    );
    let count = env
        .api::<Pod>(&a1)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    assert!(count <= 2, "{count} pods under a quota of 2");

    // Namespaces: only labelled for her tenant, only up to maxNamespaces (2; one is declared).
    let ns_as_alice: Api<Namespace> = Api::all(as_alice.clone());
    let msg = denied_eventually(
        "an unlabelled namespace is denied",
        "must label",
        || async {
            ns_as_alice
                .create(&dry_post(), &namespace(&format!("{ta}-free"), None))
                .await
        },
    )
    .await;
    assert!(msg.contains(&format!("owners of tenant {ta}")), "{msg}");
    let msg = denied_eventually(
        "a namespace for tenant B is denied",
        "not an owner",
        || async {
            ns_as_alice
                .create(&dry_post(), &namespace(&format!("{tb}-stolen"), Some(&tb)))
                .await
        },
    )
    .await;
    assert!(msg.contains(&tb), "{msg}");
    for (key, value) in [
        ("pod-security.kubernetes.io/enforce", "privileged"),
        ("tenancy.steward.dev/declared", "true"),
    ] {
        let mut ns = namespace(&format!("{ta}-sneaky"), Some(&ta));
        ns.metadata
            .labels
            .get_or_insert_default()
            .insert(key.into(), value.into());
        let err = ns_as_alice
            .create(&dry_post(), &ns)
            .await
            .expect_err("operator labels at creation");
        assert!(
            code(&err) == Some(403) && err.to_string().contains("may carry only the label"),
            "{key}: {err}"
        );
    }
    // A name another Tenant lists is reserved for it, even before its operator creates it (this
    // Tenant has no operator: no test's operator selects it).
    let reserved = format!("{ta}-reserved");
    let reserver = format!("{}-reserver", env.id);
    let other = fixtures::tenant(&reserver)
        .label(TEST_LABEL, "nobody")
        .owner_user("someone")
        .namespaces([&reserved])
        .build();
    env.tenants
        .create(&PostParams::default(), &other)
        .await
        .expect("reserving Tenant");
    let msg = denied_eventually(
        "a namespace another Tenant lists is reserved",
        "is reserved",
        || async {
            ns_as_alice
                .create(&dry_post(), &namespace(&reserved, Some(&ta)))
                .await
        },
    )
    .await;
    assert!(msg.contains(&reserver), "{msg}");
    env.tenants
        .delete(&reserver, &DeleteParams::default())
        .await
        .expect("delete the reserving Tenant");

    let own = format!("{ta}-self");
    ns_as_alice
        .create(&PostParams::default(), &namespace(&own, Some(&ta)))
        .await
        .expect("alice creates a namespace for her tenant");
    let api = env.tenants.clone();
    eventually(
        "the owner-made namespace joins the tenant",
        WAIT,
        || async {
            let t = api.get(&ta).await.map_err(|e| e.to_string())?;
            let s = t.status.unwrap_or_default();
            if s.namespaces.contains(&own) {
                Ok(())
            } else {
                Err(format!("{:?}", s.namespaces))
            }
        },
    )
    .await
    .unwrap();
    let rbs = env.api::<RoleBinding>(&own);
    eventually(
        "owner-made namespace gets the owners' RoleBinding",
        WAIT,
        || async {
            rbs.get("tenant-owner-admin")
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await
    .unwrap();
    let err = ns_as_alice
        .create(
            &PostParams::default(),
            &namespace(&format!("{ta}-third"), Some(&ta)),
        )
        .await
        .expect_err("a third namespace exceeds maxNamespaces");
    assert!(
        code(&err) == Some(403) && err.to_string().contains("maxNamespaces"),
        "{err}"
    );

    // Tenant labels of her namespaces are not hers to change, even with namespace patch rights.
    let patcher = format!("{}-ns-patcher", env.id);
    let cr = fixtures::cluster_role(
        &patcher,
        vec![fixtures::rule(
            &[""],
            &["namespaces"],
            &["get", "patch", "update"],
        )],
    );
    Api::<ClusterRole>::all(env.client.clone())
        .create(&PostParams::default(), &cr)
        .await
        .unwrap();
    let crb = fixtures::cluster_role_binding(&patcher, vec![fixtures::rbac_user(&alice)]);
    Api::<ClusterRoleBinding>::all(env.client.clone())
        .create(&PostParams::default(), &crb)
        .await
        .unwrap();
    let relabel = |patch: Value| {
        let api = ns_as_alice.clone();
        let a1 = a1.clone();
        async move {
            api.patch(&a1, &PatchParams::default(), &Patch::Merge(patch))
                .await
        }
    };
    eventually("alice may patch namespaces", WAIT, || async {
        relabel(json!({"metadata": {"labels": {"color": "blue"}}}))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("unrelated labels are hers");
    let err = relabel(json!({"metadata": {"labels": {TENANT_LABEL: null}}}))
        .await
        .expect_err("remove tenant label");
    assert!(
        code(&err) == Some(403)
            && err
                .to_string()
                .contains("tenancy.steward.dev-namespace-labels"),
        "{err}"
    );
    let err = relabel(json!({"metadata": {"labels": {TENANT_LABEL: tb}}}))
        .await
        .expect_err("move to tenant B");
    assert_eq!(code(&err), Some(403), "{err}");
    let err = relabel(
        json!({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}}),
    )
    .await
    .expect_err("relax pod security");
    assert_eq!(code(&err), Some(403), "{err}");
    // Reproduced on main (#17): pinning `enforce-version` to an old release weakened the level.
    let err = relabel(
        json!({"metadata": {"labels": {"pod-security.kubernetes.io/enforce-version": "v1.0"}}}),
    )
    .await
    .expect_err("pin pod security to an old version");
    assert_eq!(code(&err), Some(403), "{err}");

    // Cordoned: frozen, subresources and CONNECT included (reproduced on main, #17: scale,
    // eviction, token requests and exec passed a cordon).
    let deployments: Api<Deployment> = Api::namespaced(as_alice.clone(), &a1);
    let pods: Api<Pod> = Api::namespaced(as_alice.clone(), &a1);
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(as_alice.clone(), &a1);
    let tiny = || fixtures::resource_list([("cpu", "10m"), ("memory", "16Mi")]);
    let web = fixtures::deployment(
        "scaled",
        0,
        fixtures::pod_spec([Container {
            resources: Some(ResourceRequirements {
                requests: Some(tiny()),
                limits: Some(tiny()),
                ..ResourceRequirements::default()
            }),
            ..fixtures::container("app", "registry.k8s.io/pause:3.10")
        }]),
    );
    env.api::<Deployment>(&a1)
        .create(&PostParams::default(), &web)
        .await
        .expect("a Deployment to scale");
    // The quota (2 pods) is full: evict and exec into one of the running pods.
    let victim = eventually("a running pod", WAIT, || async {
        env.api::<Pod>(&a1)
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .first()
            .map(ResourceExt::name_any)
            .ok_or_else(|| "no pod yet".to_string())
    })
    .await
    .expect("a pod");
    let scale = || async {
        deployments
            .patch_scale(
                "scaled",
                &PatchParams {
                    dry_run: true,
                    ..Default::default()
                },
                &Patch::Merge(json!({"spec": {"replicas": 1}})),
            )
            .await
    };
    let evict = || async {
        pods.evict(
            &victim,
            &kube::api::EvictParams {
                delete_options: Some(dry_delete()),
                ..Default::default()
            },
        )
        .await
    };
    let token = || async {
        accounts
            .create_token_request(
                "default",
                &dry_post(),
                &k8s_openapi::api::authentication::v1::TokenRequest::default(),
            )
            .await
    };
    // A CONNECT: without an upgrade the API server refuses it after admission, so only the
    // cordon makes it a 403.
    let exec = || async {
        let req = http::Request::post(format!(
            "/api/v1/namespaces/{a1}/pods/{victim}/exec?command=true&stdout=true"
        ))
        .body(Vec::new())
        .unwrap();
        as_alice.request_text(req).await
    };
    scale().await.expect("scaling is allowed before the cordon");
    token()
        .await
        .expect("token requests are allowed before the cordon");
    if let Err(e) = exec().await {
        assert_ne!(
            code(&e),
            Some(403),
            "exec is not refused before the cordon: {e}"
        );
    }
    env.patch_spec(&ta, json!({"cordoned": true})).await;
    let t = env.ready(&ta).await;
    assert_eq!(t.status.unwrap().phase, Some(TenantPhase::Cordoned));
    let msg = denied_eventually("cordoned tenant frozen", "cordoned", || async {
        mine.create(&dry_post(), &configmap("frozen", &[], &[]))
            .await
    })
    .await;
    assert!(msg.contains(&ta), "{msg}");
    denied_eventually("scale is frozen", "cordoned", scale).await;
    denied_eventually("eviction is frozen", "cordoned", evict).await;
    denied_eventually("token requests are frozen", "cordoned", token).await;
    denied_eventually("exec is frozen", "cordoned", exec).await;
    env.patch_spec(&ta, json!({"cordoned": false})).await;
    eventually("uncordoned tenant thaws", WAIT, || async {
        mine.create(&dry_post(), &configmap("thawed", &[], &[]))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("thawed");
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_quota_holds_across_namespaces_under_concurrent_creates() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("quota").await;
    let t = env.id.clone();
    let (qa, qb) = (format!("{t}-a"), format!("{t}-b"));
    const LIMIT: i64 = 6;
    env.create(
        fixtures::tenant(&t)
            .owner_user("carol")
            .namespaces([&qa, &qb])
            .tenant_quota([("configmaps", LIMIT.to_string().as_str())]),
    )
    .await;
    env.ready(&t).await;

    let quotas = |ns: &str| env.api::<ResourceQuota>(ns);
    let (qa_api, qb_api) = (quotas(&qa), quotas(&qb));
    let enforced = |rq: &ResourceQuota| -> i64 {
        rq.status
            .as_ref()
            .and_then(|s| s.hard.as_ref())
            .and_then(|h| h.get("configmaps"))
            .and_then(|q| q.0.parse().ok())
            .unwrap_or(0)
    };
    // Watch the sum of the enforced limits for the whole test.
    let max_enforced = Arc::new(AtomicI64::new(0));
    let watcher = {
        let (qa_api, qb_api, max) = (qa_api.clone(), qb_api.clone(), max_enforced.clone());
        tokio::spawn(async move {
            loop {
                if let (Ok(x), Ok(y)) = (
                    qa_api.get("tenant-quota").await,
                    qb_api.get("tenant-quota").await,
                ) {
                    max.fetch_max(enforced(&x) + enforced(&y), Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    eventually("the split settles", WAIT, || async {
        let (x, y) = (
            qa_api
                .get("tenant-quota")
                .await
                .map_err(|e| e.to_string())?,
            qb_api
                .get("tenant-quota")
                .await
                .map_err(|e| e.to_string())?,
        );
        let known = [&x, &y].iter().all(|q| {
            q.status
                .as_ref()
                .and_then(|s| s.used.as_ref())
                .is_some_and(|u| u.contains_key("configmaps"))
        });
        let sum = enforced(&x) + enforced(&y);
        if known && sum == LIMIT {
            Ok(())
        } else {
            Err(format!("known={known} enforced sum {sum}"))
        }
    })
    .await
    .expect("settled");

    // 20 creates at once, 10 per namespace.
    let creates = (0..20).map(|i| {
        let ns = if i % 2 == 0 { &qa } else { &qb };
        let api = env.api::<ConfigMap>(ns);
        async move {
            api.create(
                &PostParams::default(),
                &configmap(&format!("c{i}"), &[], &[]),
            )
            .await
        }
    });
    let results = futures::future::join_all(creates).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    for r in &results {
        if let Err(e) = r {
            assert!(
                code(e) == Some(403) && e.to_string().contains("exceeded quota"),
                "{e}"
            );
        }
    }
    let count = |ns: String| {
        let api = env.api::<ConfigMap>(&ns);
        async move {
            api.list(&ListParams::default())
                .await
                .map(|l| l.items.len() as i64)
                .unwrap_or(0)
        }
    };
    let total = count(qa.clone()).await + count(qb.clone()).await;
    println!(
        "concurrent creates: {ok} of 20 admitted; {total} configmaps in the tenant (limit {LIMIT})"
    );
    assert!(
        total <= LIMIT,
        "{total} configmaps exceed the tenant limit {LIMIT}"
    );
    assert!(ok >= 1, "some creates fit");

    // Free up B: A's share grows, so A alone can fill the whole tenant, one create at a time.
    let cms_b = env.api::<ConfigMap>(&qb);
    for cm in cms_b.list(&ListParams::default()).await.unwrap().items {
        if cm.name_any() != "kube-root-ca.crt" {
            cms_b
                .delete(&cm.name_any(), &DeleteParams::default())
                .await
                .unwrap();
        }
    }
    let cms_a = env.api::<ConfigMap>(&qa);
    let mut n = 100;
    let filled = Instant::now();
    eventually("A fills the tenant", WAIT, || {
        n += 1;
        let name = format!("more{n}");
        let (cms_a, count_a, count_b) = (cms_a.clone(), count(qa.clone()), count(qb.clone()));
        let (qa_api, qb_api) = (qa_api.clone(), qb_api.clone());
        async move {
            let _ = cms_a
                .create(&PostParams::default(), &configmap(&name, &[], &[]))
                .await;
            let (x, y) = (count_a.await, count_b.await);
            if x + y == LIMIT {
                return Ok(x);
            }
            let show = |q: Result<ResourceQuota, kube::Error>| {
                q.map(|q| {
                    format!(
                        "spec {:?} status {:?}",
                        q.spec.and_then(|s| s.hard),
                        q.status
                    )
                })
                .unwrap_or_else(|e| e.to_string())
            };
            Err(format!(
                "{x} + {y}; A: {}; B: {}",
                show(qa_api.get("tenant-quota").await),
                show(qb_api.get("tenant-quota").await)
            ))
        }
    })
    .await
    .expect("A grows into B's freed share");
    println!(
        "A filled the tenant {:?} after B freed its share",
        filled.elapsed()
    );
    let total = count(qa.clone()).await + count(qb.clone()).await;
    assert_eq!(total, LIMIT);
    let err = env
        .api::<ConfigMap>(&qb)
        .create(&PostParams::default(), &configmap("late", &[], &[]))
        .await
        .expect_err("tenant full");
    assert!(err.to_string().contains("exceeded quota"), "{err}");

    let api = env.tenants.clone();
    eventually("status sums the usage", WAIT, || async {
        let s = api
            .get(&t)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        let used = s
            .quota
            .as_ref()
            .and_then(|q| q.used.get("configmaps").cloned())
            .unwrap_or_default();
        let exceeded = s
            .conditions
            .iter()
            .any(|c| c.type_ == QUOTA_EXCEEDED && c.status == "True");
        if used == LIMIT.to_string() && exceeded {
            Ok(())
        } else {
            Err(format!("used {used}, exceeded {exceeded}"))
        }
    })
    .await
    .expect("status");
    watcher.abort();
    let max = max_enforced.load(Ordering::SeqCst);
    println!("highest sum of enforced limits seen: {max} (limit {LIMIT})");
    assert!(
        max <= LIMIT,
        "the enforced limits summed to {max} > {LIMIT}"
    );
    env.stop().await;
}

/// Found by reading the code (#17): the admission policies were applied once per leadership
/// term, so a deleted binding stayed deleted and a weakened policy stayed weak. The leader now
/// watches them and restores them. Runs alone: the policies are briefly missing for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_policies_are_restored_when_deleted_or_changed() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let _alone = EXCLUSIVE.write().await;
    let mut env = Env::start("vap").await;
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(env.client.clone());
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(env.client.clone());
    let cordon = format!("{}-cordon", tenant_operator::policy::PREFIX);
    let labels = format!("{}-namespace-labels", tenant_operator::policy::PREFIX);
    let original = eventually("the policies are in place", WAIT, || async {
        bindings.get(&cordon).await.map_err(|e| e.to_string())?;
        policies.get(&labels).await.map_err(|e| e.to_string())
    })
    .await
    .unwrap();

    // A deleted binding comes back (a new object).
    let uid = bindings.get(&cordon).await.unwrap().uid();
    bindings
        .delete(&cordon, &DeleteParams::default())
        .await
        .unwrap();
    eventually("the deleted binding is restored", WAIT, || async {
        match bindings.get_opt(&cordon).await.map_err(|e| e.to_string())? {
            Some(b) if b.uid() != uid => Ok(()),
            Some(_) => Err("the old binding is still there".to_string()),
            None => Err("missing".to_string()),
        }
    })
    .await
    .unwrap();

    // A policy weakened by someone else is put back as it was.
    policies
        .patch(
            &labels,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"validations": [{"expression": "true"}]}})),
        )
        .await
        .unwrap();
    eventually("the weakened policy is restored", WAIT, || async {
        let p = policies.get(&labels).await.map_err(|e| e.to_string())?;
        let now = p.spec.and_then(|s| s.validations);
        if now == original.spec.clone().and_then(|s| s.validations) {
            Ok(())
        } else {
            Err(format!("validations now {now:?}"))
        }
    })
    .await
    .unwrap();
    env.stop().await;
}

/// Reproduced on main (#17): with `maxNamespaces: 2` and one namespace used, five parallel
/// `kubectl create ns` made six, and the Tenant still said Ready. Admission checks only the
/// Tenant's status, so namespaces created at the same instant all pass it; the operator admits
/// the oldest within the limit and deletes the rest before anyone is given access in them.
/// Ten rounds of fifty parallel creates by the owner; a watcher checks throughout that the
/// owner's access (the tenant's RoleBindings) is only ever in admitted namespaces and that no
/// more than `maxNamespaces` are admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_namespaces_holds_under_fifty_parallel_creates() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("maxns").await;
    let t = env.id.clone();
    let owner = format!("olga-{t}");
    let declared = format!("{t}-decl");
    const MAX: usize = 3;
    const ROUNDS: usize = 10;
    const PARALLEL: usize = 50;
    env.create(
        fixtures::tenant(&t)
            .owner_user(&owner)
            .namespaces([&declared])
            .max_namespaces(i32::try_from(MAX).unwrap()),
    )
    .await;
    env.ready(&t).await;
    let as_owner: Api<Namespace> = Api::all(env.as_user(&owner));
    eventually("the owner may create namespaces", WAIT, || async {
        as_owner
            .create(&dry_post(), &namespace(&format!("{t}-probe"), Some(&t)))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();

    // The watcher: RoleBindings are listed before namespaces, so a namespace with the
    // owner's access was admitted before the namespace list was taken.
    let selector = format!("{TENANT_LABEL}={t}");
    let violations = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let most_admitted = Arc::new(AtomicI64::new(0));
    let watcher = {
        let (client, selector) = (env.client.clone(), selector.clone());
        let (violations, most_admitted) = (violations.clone(), most_admitted.clone());
        tokio::spawn(async move {
            let lp = ListParams::default().labels(&selector);
            loop {
                let rbs = Api::<RoleBinding>::all(client.clone()).list(&lp).await;
                let nss = Api::<Namespace>::all(client.clone()).list(&lp).await;
                if let (Ok(rbs), Ok(nss)) = (rbs, nss) {
                    let admitted: BTreeMap<String, bool> = nss
                        .items
                        .iter()
                        .filter(|n| n.metadata.deletion_timestamp.is_none())
                        .map(|n| {
                            let yes = n.labels().get(ADMITTED_LABEL) == Some(&"true".to_string());
                            (n.name_any(), yes)
                        })
                        .collect();
                    let count = admitted.values().filter(|a| **a).count();
                    most_admitted.fetch_max(count as i64, Ordering::SeqCst);
                    let mut v = violations.lock().unwrap();
                    if count > MAX {
                        v.push(format!("{count} admitted namespaces: {admitted:?}"));
                    }
                    for rb in &rbs.items {
                        let ns = rb.namespace().unwrap_or_default();
                        if admitted.get(&ns) == Some(&false) {
                            v.push(format!(
                                "RoleBinding {} in namespace {ns}, not admitted",
                                rb.name_any()
                            ));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let status_namespaces = || async {
        let tenant = env.tenants.get(&t).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(tenant.status.unwrap_or_default().namespaces)
    };
    let mut admitted_past_admission = 0;
    for round in 0..ROUNDS {
        let creates = (0..PARALLEL).map(|i| {
            let as_owner = as_owner.clone();
            let name = format!("{t}-r{round}-{i:02}");
            let tenant = t.clone();
            async move {
                as_owner
                    .create(&PostParams::default(), &namespace(&name, Some(&tenant)))
                    .await
                    .map(|_| name)
            }
        });
        let created: Vec<String> = futures::future::join_all(creates)
            .await
            .into_iter()
            .filter_map(Result::ok)
            .collect();
        admitted_past_admission = admitted_past_admission.max(created.len());
        // The tenant settles on the declared namespace and the MAX - 1 oldest of this round.
        let kept = eventually(&format!("round {round} settles"), WAIT, || async {
            let live: Vec<String> = Api::<Namespace>::all(env.client.clone())
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .filter(|n| n.metadata.deletion_timestamp.is_none())
                .map(|n| n.name_any())
                .collect();
            let listed = status_namespaces().await?;
            if live.len() == MAX && listed == live {
                Ok(live)
            } else {
                Err(format!("live {live:?}, status {listed:?}"))
            }
        })
        .await
        .unwrap();
        assert!(kept.contains(&declared), "{kept:?}");
        // Make room for the next round.
        for ns in kept.iter().filter(|n| **n != declared) {
            Api::<Namespace>::all(env.client.clone())
                .delete(ns, &DeleteParams::default())
                .await
                .unwrap();
        }
        eventually(&format!("round {round} cleared"), WAIT, || async {
            let listed = status_namespaces().await?;
            if listed == [declared.clone()] {
                Ok(())
            } else {
                Err(format!("{listed:?}"))
            }
        })
        .await
        .unwrap();
    }
    watcher.abort();
    println!(
        "most namespaces admitted at once: {}; most creates passing admission in one round: {admitted_past_admission}",
        most_admitted.load(Ordering::SeqCst)
    );
    let violations = violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(
        admitted_past_admission > MAX - 1,
        "admission alone held the limit in every round, so the race was not exercised"
    );
    env.stop().await;
}

/// Reproduced on main (#17): a Tenant listing an existing namespace, even the operator's own,
/// took it, made its owner admin there, and deleted it with the Tenant. Now a Tenant takes only
/// namespaces created for it or handed over by a cluster admin's annotation, never a system or
/// Steward namespace, and releases (never deletes) what it adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_takes_only_namespaces_created_for_it_or_handed_over() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("adopt").await;
    let t = format!("{}-t", env.id);
    let (plain, handed, fresh) = (
        format!("{t}-plain"),
        format!("{t}-handed"),
        format!("{t}-fresh"),
    );
    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    namespaces
        .create(&PostParams::default(), &namespace(&plain, None))
        .await
        .unwrap();
    let mut ns = namespace(&handed, None);
    ns.metadata.annotations = Some(labels(&[("tenancy.steward.dev/adopt-by", t.as_str())]));
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let mut secret = Secret::default();
    secret.metadata.name = Some("db-admin".into());
    env.api::<Secret>(&plain)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();

    env.create(
        fixtures::tenant(&t)
            .owner_user("erin")
            .namespaces([&plain, &handed, &fresh, "tenant-operator-system"])
            .deletion_policy(NamespaceDeletionPolicy::Delete),
    )
    .await;
    let status = eventually("the Tenant reports what it refused", WAIT, || async {
        let status = env
            .tenants
            .get(&t)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        let ready = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .cloned();
        match ready {
            Some(c) if c.reason == "NamespaceNotAdoptable" && status.namespaces.len() == 2 => {
                Ok((status, c))
            }
            other => Err(format!("{:?} {other:?}", status.namespaces)),
        }
    })
    .await
    .expect("refusals reported");
    let (status, ready) = status;
    assert_eq!(ready.status, "False");
    assert_eq!(status.namespaces, [fresh.clone(), handed.clone()]);
    assert_eq!(status.adopted_namespaces, std::slice::from_ref(&handed));
    for refused in [plain.as_str(), "tenant-operator-system"] {
        assert!(
            ready.message.contains(&format!("namespace {refused} ")),
            "{refused} named: {}",
            ready.message
        );
    }
    assert!(
        ready.message.contains("tenancy.steward.dev/adopt-by="),
        "says how to hand a namespace over: {}",
        ready.message
    );
    // The owner got nothing in the refused namespaces.
    let as_erin = env.as_user("erin");
    for ns in [plain.as_str(), "tenant-operator-system"] {
        let err = Api::<Secret>::namespaced(as_erin.clone(), ns)
            .list(&ListParams::default())
            .await
            .expect_err("no access");
        assert_eq!(code(&err), Some(403), "{ns}: {err}");
    }
    assert!(
        !namespaces
            .get(&plain)
            .await
            .unwrap()
            .labels()
            .contains_key(TENANT_LABEL),
        "the unmarked namespace is untouched"
    );
    eventually(
        "the owner administers the handed-over namespace",
        WAIT,
        || async {
            Api::<Secret>::namespaced(as_erin.clone(), &handed)
                .list(&ListParams::default())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await
    .expect("owner access in the adopted namespace");

    env.tenants
        .delete(&t, &DeleteParams::default())
        .await
        .unwrap();
    env.tenant_gone(&t).await;
    env.gone(&namespaces, &fresh).await;
    let kept = namespaces
        .get(&handed)
        .await
        .expect("adopted namespace stays");
    assert!(kept.metadata.deletion_timestamp.is_none(), "never deleted");
    assert!(
        !kept.labels().contains_key(TENANT_LABEL)
            && !kept.labels().contains_key("tenancy.steward.dev/adopted"),
        "released: {:?}",
        kept.labels()
    );
    assert!(
        namespaces.get(&plain).await.is_ok(),
        "the unmarked one stays"
    );
    assert!(
        env.api::<Secret>(&plain).get("db-admin").await.is_ok(),
        "and so does its Secret"
    );
    for ns in [plain, handed] {
        let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    }
    env.stop().await;
}

/// Reproduced on main (#17): a tenant-wide limit below the per-namespace one was applied
/// silently (each namespace got 5 pods of a promised 50) while the status said nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_limit_below_the_per_namespace_one_is_reported() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("split").await;
    let t = format!("{}-t", env.id);
    let (a, b) = (format!("{t}-a"), format!("{t}-b"));
    env.create(
        fixtures::tenant(&t)
            .owner_user("fay")
            .namespaces([&a, &b])
            .resource_quota([("pods", "50")])
            .tenant_quota([("pods", "10")]),
    )
    .await;
    env.ready(&t).await;
    let message = eventually("the split is reported", WAIT, || async {
        let status = env
            .tenants
            .get(&t)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        let c = status
            .conditions
            .iter()
            .find(|c| c.type_ == QUOTA_EXCEEDED)
            .ok_or("no QuotaExceeded yet")?;
        if c.message.contains("shared") {
            Ok(c.message.clone())
        } else {
            Err(format!("{}: {}", c.reason, c.message))
        }
    })
    .await
    .expect("reported");
    assert_eq!(
        message,
        format!("pods: the tenant's 10 are shared, {a} 5, {b} 5 (resourceQuota 50 each)")
    );
    for ns in [&a, &b] {
        let rq = env
            .api::<ResourceQuota>(ns)
            .get("tenant-quota")
            .await
            .unwrap();
        assert_eq!(rq.spec.unwrap().hard.unwrap()["pods"].0, "5", "{ns}");
    }
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_policies_refuse_what_the_tenant_may_not_run_even_through_a_controller() {
    use k8s_openapi::api::apps::v1::ReplicaSet;
    use k8s_openapi::api::core::v1::{
        PersistentVolumeClaim, PersistentVolumeClaimSpec, Service, ServicePort, ServiceSpec,
        VolumeResourceRequirements,
    };
    use k8s_openapi::api::networking::v1::{
        Ingress, IngressBackend, IngressServiceBackend, IngressSpec, ServiceBackendPort,
    };

    use k8s_openapi::api::node::v1::RuntimeClass;

    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("rules").await;
    let t = format!("{}-t", env.id);
    let ns = format!("{t}-a");
    let registry = "registry.example.com/team/";
    // Two RuntimeClasses (Kubernetes' own admission refuses a pod naming one that does not
    // exist); the first is the tenant's default.
    let (sandboxed, plain) = (format!("{}-sandboxed", env.id), format!("{}-plain", env.id));
    let runtime_classes: Api<RuntimeClass> = Api::all(env.client.clone());
    for class in [&sandboxed, &plain] {
        runtime_classes
            .create(
                &PostParams::default(),
                &RuntimeClass {
                    metadata: fixtures::meta(class),
                    handler: "runc".into(),
                    ..RuntimeClass::default()
                },
            )
            .await
            .expect("RuntimeClass");
    }
    env.create(
        fixtures::tenant(&t)
            .owner_user("rita")
            .namespaces([&ns])
            .policies(TenantPolicies {
                allowed_registries: vec![registry.to_string(), "registry.k8s.io".to_string()],
                image_pull_policy: Some(PullPolicy::Always),
                allowed_storage_classes: vec!["standard".into()],
                allowed_ingress_classes: vec!["internal".into()],
                forbidden_service_types: vec![ServiceType::NodePort, ServiceType::LoadBalancer],
                forbid_external_ips: true,
                node_selector: fixtures::map([("pool", "team"), ("example.com/zone", "a")]),
                allowed_runtime_classes: vec![sandboxed.clone(), plain.clone()],
                default_runtime_class: Some(sandboxed.clone()),
                ..TenantPolicies::default()
            }),
    )
    .await;
    env.ready(&t).await;
    let owner = env.as_user("rita");
    let because = |key: &str, value: &str| format!("(spec.policies.{key} of tenant {t}: {value})");

    let pods: Api<Pod> = Api::namespaced(owner.clone(), &ns);
    let pod_with = |image: &str, pull: &str, pinned: bool| -> Pod {
        let mut spec = fixtures::pod_spec([Container {
            image_pull_policy: Some(pull.into()),
            ..fixtures::container("app", image)
        }]);
        if pinned {
            spec.node_selector = Some(fixtures::map([("pool", "team"), ("example.com/zone", "a")]));
        }
        fixtures::pod("p", spec)
    };
    let good = format!("{registry}app:1");
    let message = denied_eventually(
        "a pod from another registry",
        "not from an allowed registry",
        || async {
            pods.create(
                &dry_post(),
                &pod_with("docker.io/library/nginx:1", "Always", true),
            )
            .await
        },
    )
    .await;
    let registries = format!("{registry},registry.k8s.io");
    assert!(
        message.contains(&format!(
            "image docker.io/library/nginx:1 is not from an allowed registry {}",
            because("allowedRegistries", &registries)
        )),
        "{message}"
    );
    // An entry matches whole segments: a registry is not a prefix of another host's name.
    let message = denied_eventually(
        "a pod from a host whose name starts with an allowed registry's",
        "not from an allowed registry",
        || async {
            pods.create(
                &dry_post(),
                &pod_with("registry.k8s.io.evil.example/pause:3.10", "Always", true),
            )
            .await
        },
    )
    .await;
    assert!(
        message.contains("image registry.k8s.io.evil.example/pause:3.10 is not from"),
        "{message}"
    );
    pods.create(
        &dry_post(),
        &pod_with("registry.k8s.io/pause:3.10", "Always", true),
    )
    .await
    .expect("an image of an allowed registry");
    for (what, pod, needle) in [
        (
            "a container pulled IfNotPresent",
            pod_with(&good, "IfNotPresent", true),
            format!(
                "every container must have imagePullPolicy Always {}",
                because("imagePullPolicy", "Always")
            ),
        ),
        (
            "a pod pinned to other nodes",
            {
                let mut p = pod_with(&good, "Always", false);
                p.spec.as_mut().unwrap().node_selector =
                    Some(BTreeMap::from([("pool".to_string(), "other".to_string())]));
                p
            },
            format!(
                "the pod must have nodeSelector example.com/zone=a,pool=team {}",
                because("nodeSelector", "example.com/zone=a,pool=team")
            ),
        ),
    ] {
        let err = pods.create(&dry_post(), &pod).await.expect_err(what);
        assert!(
            code(&err) == Some(403) && err.to_string().contains(&needle),
            "{what}: {err}"
        );
    }
    pods.create(&dry_post(), &pod_with(&good, "Always", true))
        .await
        .expect("a pod that keeps every rule is admitted");
    // The defaults: a pod lacking the tenant's node labels is given them (keeping its own),
    // and one naming no RuntimeClass is given the default; a class it names is kept.
    let mut partly_pinned = pod_with(&good, "Always", false);
    partly_pinned.spec.as_mut().unwrap().node_selector = Some(BTreeMap::from([
        ("pool".to_string(), "team".to_string()),
        ("disk".to_string(), "ssd".to_string()),
    ]));
    for (what, pod, class) in [
        (
            "a pod with no nodeSelector",
            pod_with(&good, "Always", false),
            &sandboxed,
        ),
        ("a pod with some of the labels", partly_pinned, &sandboxed),
        (
            "a pod naming an allowed class",
            {
                let mut p = pod_with(&good, "Always", false);
                p.spec.as_mut().unwrap().runtime_class_name = Some(plain.clone());
                p
            },
            &plain,
        ),
    ] {
        let admitted = pods
            .create(&dry_post(), &pod)
            .await
            .unwrap_or_else(|e| panic!("{what} is admitted with the defaults: {e}"));
        let spec = admitted.spec.unwrap();
        let selector = spec.node_selector.unwrap_or_default();
        assert_eq!(
            selector.get("pool").map(String::as_str),
            Some("team"),
            "{what}: {selector:?}"
        );
        assert_eq!(
            selector.get("example.com/zone").map(String::as_str),
            Some("a"),
            "{what}: {selector:?}"
        );
        let own = pod.spec.unwrap().node_selector.unwrap_or_default();
        assert_eq!(
            selector.len(),
            2 + own.keys().filter(|k| *k == "disk").count(),
            "{what}: {selector:?}"
        );
        assert_eq!(spec.runtime_class_name.as_ref(), Some(class), "{what}");
    }

    let services: Api<Service> = Api::namespaced(owner.clone(), &ns);
    let service = |spec: ServiceSpec| -> Service {
        Service {
            metadata: fixtures::meta("s"),
            spec: Some(ServiceSpec {
                ports: Some(vec![ServicePort {
                    port: 80,
                    ..ServicePort::default()
                }]),
                ..spec
            }),
            ..Service::default()
        }
    };
    let of_type = |type_: &str| ServiceSpec {
        type_: Some(type_.into()),
        ..ServiceSpec::default()
    };
    for (what, spec, needle) in [
        (
            "a NodePort Service",
            of_type("NodePort"),
            "Services of type NodePort are forbidden",
        ),
        (
            "a LoadBalancer Service",
            of_type("LoadBalancer"),
            "Services of type LoadBalancer are forbidden",
        ),
        (
            "a Service with externalIPs",
            ServiceSpec {
                external_ips: Some(vec!["198.18.0.9".into()]),
                ..ServiceSpec::default()
            },
            "Services with externalIPs are forbidden",
        ),
    ] {
        let err = services
            .create(&dry_post(), &service(spec))
            .await
            .expect_err(what);
        assert!(
            code(&err) == Some(403) && err.to_string().contains(needle),
            "{what}: {err}"
        );
    }
    services
        .create(&dry_post(), &service(ServiceSpec::default()))
        .await
        .expect("a ClusterIP Service is admitted");

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(owner.clone(), &ns);
    let claim = |class: Option<&str>| -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: fixtures::meta("c"),
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(fixtures::resource_list([("storage", "1Gi")])),
                    ..VolumeResourceRequirements::default()
                }),
                storage_class_name: class.map(str::to_string),
                ..PersistentVolumeClaimSpec::default()
            }),
            ..PersistentVolumeClaim::default()
        }
    };
    for class in [Some("fast"), None] {
        let err = claims
            .create(&dry_post(), &claim(class))
            .await
            .expect_err("claim");
        assert!(
            code(&err) == Some(403)
                && err
                    .to_string()
                    .contains("a PersistentVolumeClaim must name one of the allowed classes"),
            "{class:?}: {err}"
        );
    }
    claims
        .create(&dry_post(), &claim(Some("standard")))
        .await
        .expect("a claim of an allowed class is admitted");

    let ingresses: Api<Ingress> = Api::namespaced(owner.clone(), &ns);
    let ingress = |class: &str| -> Ingress {
        Ingress {
            metadata: fixtures::meta("i"),
            spec: Some(IngressSpec {
                ingress_class_name: Some(class.into()),
                default_backend: Some(IngressBackend {
                    service: Some(IngressServiceBackend {
                        name: "s".into(),
                        port: Some(ServiceBackendPort {
                            number: Some(80),
                            ..ServiceBackendPort::default()
                        }),
                    }),
                    ..IngressBackend::default()
                }),
                ..IngressSpec::default()
            }),
            ..Ingress::default()
        }
    };
    let err = ingresses
        .create(&dry_post(), &ingress("public"))
        .await
        .expect_err("class");
    assert!(
        err.to_string()
            .contains("an Ingress must name one of the allowed classes"),
        "{err}"
    );
    ingresses
        .create(&dry_post(), &ingress("internal"))
        .await
        .expect("an Ingress of an allowed class is admitted");

    // A Deployment is admitted, but the ReplicaSet controller cannot create its pods: the rules
    // hold for what controllers create on the tenant's behalf.
    let always = |image: &str| Container {
        image_pull_policy: Some("Always".into()),
        ..fixtures::container("app", image)
    };
    let deployment = fixtures::deployment(
        "web",
        1,
        PodSpec {
            node_selector: Some(fixtures::map([("pool", "team")])),
            ..fixtures::pod_spec([always("docker.io/library/nginx:1")])
        },
    );
    Api::<Deployment>::namespaced(owner.clone(), &ns)
        .create(&PostParams::default(), &deployment)
        .await
        .expect("the Deployment itself is admitted");
    let sets: Api<ReplicaSet> = Api::namespaced(env.client.clone(), &ns);
    let failure = eventually("the ReplicaSet reports its pods refused", WAIT, || async {
        let list = sets
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .iter()
            .flat_map(|rs| rs.status.iter().flat_map(|s| s.conditions.iter().flatten()))
            .find(|c| c.type_.as_deref() == Some("ReplicaFailure"))
            .and_then(|c| c.message.clone())
            .ok_or_else(|| format!("{} ReplicaSets, no ReplicaFailure yet", list.items.len()))
    })
    .await
    .expect("refused");
    assert!(
        failure.contains("is not from an allowed registry"),
        "{failure}"
    );

    // The defaults hold for what controllers create too: a Deployment that says nothing of
    // nodes or runtimes gets pods pinned to the tenant's nodes, in its default runtime.
    let plain_deployment = fixtures::deployment("api", 1, fixtures::pod_spec([always(&good)]));
    Api::<Deployment>::namespaced(owner.clone(), &ns)
        .create(&PostParams::default(), &plain_deployment)
        .await
        .expect("a Deployment without a nodeSelector is admitted");
    let all_pods: Api<Pod> = Api::namespaced(env.client.clone(), &ns);
    let created = eventually("the Deployment's pod", WAIT, || async {
        all_pods
            .list(&ListParams::default().labels("app=api"))
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .next()
            .ok_or_else(|| "no pod yet".to_string())
    })
    .await
    .expect("the ReplicaSet's pod is admitted");
    let spec = created.spec.unwrap();
    assert_eq!(
        spec.node_selector,
        Some(BTreeMap::from([
            ("example.com/zone".to_string(), "a".to_string()),
            ("pool".to_string(), "team".to_string()),
        ]))
    );
    assert_eq!(spec.runtime_class_name.as_ref(), Some(&sandboxed));

    // The rules' ConfigMap is the operator's: the owner can neither change nor delete it.
    let params: Api<ConfigMap> = Api::namespaced(owner.clone(), &ns);
    let err = params
        .delete("tenancy.steward.dev-policies", &dry_delete())
        .await
        .expect_err("the owner cannot delete the rules");
    assert_eq!(code(&err), Some(403), "{err}");

    // Without policies, the same pod passes.
    env.tenants
        .patch(
            &t,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"policies": null}})),
        )
        .await
        .expect("drop the policies");
    eventually("the rules are lifted", WAIT, || async {
        pods.create(
            &dry_post(),
            &pod_with("docker.io/library/nginx:1", "IfNotPresent", false),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    })
    .await
    .expect("lifted");

    // A pod admitted before the rules can still be labelled (or finalized, or orphaned by
    // the garbage collector) after they return; changing its spec is judged.
    let old = pods
        .create(
            &PostParams::default(),
            &pod_with("docker.io/library/nginx:1", "IfNotPresent", false),
        )
        .await
        .expect("a pod made while there are no rules");
    env.tenants
        .patch(
            &t,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"policies": {"allowedRegistries": [registry]}}})),
        )
        .await
        .expect("the rules again");
    denied_eventually(
        "the rules are back",
        "not from an allowed registry",
        || async {
            pods.create(
                &dry_post(),
                &pod_with("docker.io/library/nginx:1", "IfNotPresent", false),
            )
            .await
        },
    )
    .await;
    pods.patch(
        &old.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"reviewed": "yes"}}})),
    )
    .await
    .expect("a metadata-only update of an older pod is not judged by the rules");
    let err = pods
        .patch(
            &old.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(
                serde_json::from_value(json!([
                    {"op": "replace", "path": "/spec/containers/0/image", "value": "docker.io/library/nginx:2"}
                ]))
                .unwrap(),
            ),
        )
        .await
        .expect_err("a new image from another registry");
    assert!(
        code(&err) == Some(403) && err.to_string().contains("not from an allowed registry"),
        "{err}"
    );
    for class in [&sandboxed, &plain] {
        let _ = runtime_classes
            .delete(class, &DeleteParams::default())
            .await;
    }
    env.stop().await;
}

/// Issue #39, item 2: the tenant rules fail closed. A tenant namespace whose policy
/// parameters are missing (deleted by a cluster admin while the operator was down, or not
/// written yet) admits no pod, even for a tenant without `spec.policies`; the operator
/// writes them back (empty for such a tenant) and pods are admitted again. With
/// `parameterNotFoundAction: Allow` the pod below was admitted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_namespace_without_its_policy_parameters_admits_no_pod() {
    use tenant_operator::build::POLICY_PARAMS;

    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("closed").await;
    let t = format!("{}-t", env.id);
    let ns = format!("{t}-a");
    env.create(fixtures::tenant(&t).owner_user("rita").namespaces([&ns]))
        .await;
    env.ready(&t).await;
    let pods: Api<Pod> = env.api(&ns);
    let params: Api<ConfigMap> = env.api(&ns);
    let written = params.get(POLICY_PARAMS).await.expect("the parameters");
    assert_eq!(
        written.data.unwrap_or_default(),
        BTreeMap::new(),
        "a tenant without spec.policies gets its parameters, with no rule"
    );
    pods.create(&dry_post(), &pod("p"))
        .await
        .expect("admitted with the (empty) parameters in place");

    // The operator is down; a cluster admin deletes the parameters.
    env.stop().await;
    params
        .delete(POLICY_PARAMS, &DeleteParams::default())
        .await
        .expect("a cluster admin may delete them");
    // Refused by the pod policies (the mutating one first).
    let message = denied_eventually(
        "a pod in a namespace without its parameters",
        "tenancy.steward.dev-pod",
        || async { pods.create(&dry_post(), &pod("p")).await },
    )
    .await;
    eprintln!("refused without parameters: {message}");

    // Back up, the operator writes them again and pods are admitted.
    env.operator = Some(start_operator(env.cp, &env.id, Duration::from_secs(3600)).await);
    eventually("a pod admitted again", WAIT, || async {
        pods.create(&dry_post(), &pod("p"))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();
    env.stop().await;
}

/// What a watch started before a Tenant saw of its RoleBindings: each one, the first time it
/// was seen, as `namespace/name` with the verdict of a check of the cluster as it was at the
/// binding's own revision.
type Verdicts = Arc<std::sync::Mutex<Vec<(String, Result<(), String>)>>>;

/// A list of the cluster as it was at revision `rv` (`resourceVersionMatch=Exact`): what
/// existed when an object of that revision was written, however soon after it a reader looks.
fn as_of(rv: &str) -> ListParams {
    ListParams::default()
        .at(rv)
        .matching(kube::api::VersionMatch::Exact)
}

/// Watches the owners' RoleBindings labelled for tenant `t` (from before any exists; not the
/// operator's own access binding) and checks each new one with `verdict(client, namespace,
/// revision)`; returns once the watch is listening.
async fn audit_bindings<F, Fut>(
    client: Client,
    t: &str,
    verdict: F,
) -> (Verdicts, tokio::task::JoinHandle<()>)
where
    F: Fn(Client, String, String) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let checked = Verdicts::default();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let selector = format!("{TENANT_LABEL}={t}");
    let task = {
        let checked = checked.clone();
        tokio::spawn(async move {
            let mut ready_tx = Some(ready_tx);
            let mut seen = std::collections::BTreeSet::new();
            let stream = watcher(
                Api::<RoleBinding>::all(client.clone()),
                watcher::Config::default().labels(&selector),
            )
            .default_backoff();
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                let rb = match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = ready_tx.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    Ok(watcher::Event::Apply(rb) | watcher::Event::InitApply(rb)) => rb,
                    _ => continue,
                };
                let ns = rb.namespace().unwrap_or_default();
                // The operator's own access binding comes first by design: it is how the
                // operator writes the guard rails into the namespace.
                if rb.name_any() == tenant_operator::build::ACCESS_ROLE
                    || !seen.insert((ns.clone(), rb.name_any()))
                {
                    continue;
                }
                let rv = rb.resource_version().unwrap_or_default();
                let result = verdict(client.clone(), ns.clone(), rv).await;
                checked
                    .lock()
                    .unwrap()
                    .push((format!("{ns}/{}", rb.name_any()), result));
            }
        })
    };
    ready_rx.await.expect("the watch started");
    (checked, task)
}

/// Waits until `checked` holds a binding in each of `namespaces`, stops the watch, and
/// asserts no binding failed its check (`what` says what it checked).
async fn every_binding_passed(
    checked: &Verdicts,
    task: tokio::task::JoinHandle<()>,
    namespaces: &[String],
    what: &str,
) {
    // The watch delivers every binding, in order.
    eventually("a binding seen in every namespace", WAIT, || async {
        let c = checked.lock().unwrap();
        let bound: std::collections::BTreeSet<&str> = c
            .iter()
            .filter_map(|(rb, _)| rb.split('/').next())
            .collect();
        if namespaces.iter().all(|ns| bound.contains(ns.as_str())) {
            Ok(())
        } else {
            Err(format!("bound so far: {bound:?}"))
        }
    })
    .await
    .unwrap();
    task.abort();
    let checked = checked.lock().unwrap().clone();
    let early: Vec<_> = checked.iter().filter(|(_, v)| v.is_err()).collect();
    assert!(
        early.is_empty(),
        "RoleBindings created before {what}: {early:?}"
    );
}

/// Owners get a namespace only once its quotas bind: every RoleBinding the operator creates
/// is seen by a watch started before the Tenant, and at its revision each ResourceQuota of
/// its namespace (the tenant's and the additional ones) already had all its limits in
/// `status.hard`. Before that the API server would admit anything: an owner bound earlier
/// could create unquoted objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_are_bound_only_once_the_namespace_quotas_are_enforced() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("bindlast").await;
    let t = env.id.clone();
    let namespaces: Vec<String> = (0..4).map(|i| format!("{t}-{i}")).collect();
    let (checked, watch) = audit_bindings(env.client.clone(), &t, |client, ns, rv| async move {
        let list = Api::<ResourceQuota>::namespaced(client, &ns)
            .list(&as_of(&rv))
            .await
            .map_err(|e| e.to_string())?;
        if list.items.len() < 2 {
            return Err(format!("{} ResourceQuotas", list.items.len()));
        }
        list.items.iter().try_for_each(|q| {
            let spec = q.spec.as_ref().and_then(|s| s.hard.clone());
            let hard = q.status.as_ref().and_then(|s| s.hard.clone());
            let missing: Vec<String> = spec
                .unwrap_or_default()
                .keys()
                .filter(|k| !hard.as_ref().is_some_and(|h| h.contains_key(*k)))
                .cloned()
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("{}: {missing:?} not enforced", q.name_any()))
            }
        })
    })
    .await;
    env.create(
        fixtures::tenant(&t)
            .owner_user(&format!("uma-{t}"))
            .namespaces(&namespaces)
            .resource_quota([("pods", "5"), ("configmaps", "20")])
            .additional_quota(NamedQuota {
                scopes: vec!["BestEffort".into()],
                ..fixtures::named_quota("no-best-effort", [("pods", "0")])
            }),
    )
    .await;
    env.ready(&t).await;
    every_binding_passed(
        &checked,
        watch,
        &namespaces,
        "their namespace's quotas were enforced",
    )
    .await;
    env.stop().await;
}

/// Issue #39, item 2: owners get a namespace only once its policies are in force, whoever
/// creates it. The owner creates 20 namespaces at once (each a race between the operator's
/// first reconcile of it and the owner's access); in half of them a test admission policy
/// refuses the operator's write of the policy parameters with `403 Forbidden`, as the API
/// server does while the operator's access Role there is not in force yet (the window a
/// live race could open). A watch started before sees every owner RoleBinding, and at that
/// binding's own revision the namespace already held the tenant's policy parameters (with
/// `allowedRegistries`) and the guard rails' bindings were installed: the refused namespaces
/// wait (`WaitingForPolicies`) and are bound once the refusal is lifted. With the gate on the
/// parameters taken out of the reconcile, the refused namespaces' owners are bound at once
/// and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_are_bound_only_once_the_policies_of_the_namespace_are_in_force() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    use tenant_operator::build::POLICY_PARAMS;

    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("railslast").await;
    let t = env.id.clone();
    let owner = format!("rita-{t}");
    const RACES: usize = 20;
    let (checked, watch) = audit_bindings(env.client.clone(), &t, |client, ns, rv| async move {
        let params = Api::<ConfigMap>::namespaced(client.clone(), &ns)
            .list(&as_of(&rv).fields(&format!("metadata.name={POLICY_PARAMS}")))
            .await
            .map_err(|e| e.to_string())?;
        let registries = params
            .items
            .first()
            .and_then(|c| c.data.as_ref()?.get("allowedRegistries").cloned());
        if registries.as_deref() != Some("registry.k8s.io") {
            return Err(format!("policy parameters then: {:?}", params.items));
        }
        let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client)
            .list(&as_of(&rv))
            .await
            .map_err(|e| e.to_string())?;
        let ours = bindings
            .items
            .iter()
            .filter(|b| b.name_any().starts_with("tenancy.steward.dev"))
            .count();
        if ours == 0 {
            return Err("no guard-rail policy binding installed then".into());
        }
        Ok(())
    })
    .await;
    let declared = format!("{t}-decl");
    env.create(
        fixtures::tenant(&t)
            .owner_user(&owner)
            .namespaces([&declared])
            .max_namespaces(i32::try_from(RACES + 1).unwrap())
            .policies(TenantPolicies {
                allowed_registries: vec!["registry.k8s.io".to_string()],
                ..TenantPolicies::default()
            }),
    )
    .await;
    env.ready(&t).await;
    let as_owner: Api<Namespace> = Api::all(env.as_user(&owner));
    eventually("the owner may create namespaces", WAIT, || async {
        as_owner
            .create(&dry_post(), &namespace(&format!("{t}-probe"), Some(&t)))
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();
    // The operator's write of the parameters refused, as RBAC refuses it before its access
    // Role is in force, in the namespaces labelled for it.
    let block = format!("steward.dev/block-params-{t}");
    let vap = ApiResource::erase::<ValidatingAdmissionPolicy>(&());
    let vapb = ApiResource::erase::<ValidatingAdmissionPolicyBinding>(&());
    let refusal: Vec<(ApiResource, Value)> = vec![
        (
            vap.clone(),
            json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": block.replace('/', "-")},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": {
                        "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                           "operations": ["CREATE", "UPDATE"], "resources": ["configmaps"]}],
                        "namespaceSelector": {"matchExpressions": [{"key": block, "operator": "Exists"}]},
                    },
                    "validations": [{
                        "expression": format!("object.metadata.name != '{POLICY_PARAMS}'"),
                        "reason": "Forbidden",
                        "message": "refused by the test, as RBAC refuses it before the operator's access Role is in force",
                    }],
                },
            }),
        ),
        (
            vapb.clone(),
            json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": block.replace('/', "-")},
                "spec": {"policyName": block.replace('/', "-"), "validationActions": ["Deny"]},
            }),
        ),
    ];
    for (resource, object) in &refusal {
        let api: Api<DynamicObject> = Api::all_with(env.client.clone(), resource);
        let object: DynamicObject = serde_json::from_value(object.clone()).unwrap();
        api.create(&PostParams::default(), &object).await.unwrap();
    }
    // The refusal in force: a ConfigMap of that name cannot be created in a labelled namespace.
    let probe_ns = format!("{t}-blockprobe");
    let mut probe = namespace(&probe_ns, None);
    probe.labels_mut().insert(block.clone(), "true".to_string());
    Api::<Namespace>::all(env.client.clone())
        .create(&PostParams::default(), &probe)
        .await
        .unwrap();
    denied_eventually("the parameters refused", "refused by the test", || {
        let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &probe_ns);
        async move {
            cms.create(&dry_post(), &configmap(POLICY_PARAMS, &[], &[]))
                .await
        }
    })
    .await;
    let raced: Vec<String> = (0..RACES).map(|i| format!("{t}-own-{i}")).collect();
    let blocked: Vec<String> = raced.iter().step_by(2).cloned().collect();
    let creates = raced.iter().map(|name| {
        let as_owner = as_owner.clone();
        let mut ns = namespace(name, Some(&t));
        if blocked.contains(name) {
            ns.labels_mut().insert(block.clone(), "true".to_string());
        }
        async move { as_owner.create(&PostParams::default(), &ns).await }
    });
    for created in futures::future::join_all(creates).await {
        created.expect("the owner creates a namespace of the tenant");
    }
    // The operator looked at the refused namespaces and waits: it says so.
    let tenants: Api<Tenant> = Api::all(env.client.clone());
    let waiting = eventually("the Tenant waits for the refused parameters", WAIT, || async {
        let tenant = tenants.get(&t).await.map_err(|e| e.to_string())?;
        let ready = tenant
            .status
            .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"))
            .ok_or("no Ready condition")?;
        let all_named = blocked.iter().all(|ns| {
            ready.message.contains(&format!(
                "owners get access to namespace {ns} once the parameters of its admission policies are written there"
            ))
        });
        if ready.status == "False" && all_named {
            Ok(())
        } else {
            Err(format!("{}: {} {}", ready.status, ready.reason, ready.message))
        }
    })
    .await;
    if let Err(e) = waiting {
        let early: Vec<_> = checked
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, v)| v.is_err())
            .cloned()
            .collect();
        panic!("{e}\nowner RoleBindings created before their namespace's policies: {early:?}");
    }
    for (resource, object) in refusal.iter().rev() {
        let api: Api<DynamicObject> = Api::all_with(env.client.clone(), resource);
        api.delete(
            object["metadata"]["name"].as_str().unwrap(),
            &DeleteParams::default(),
        )
        .await
        .unwrap();
    }
    Api::<Namespace>::all(env.client.clone())
        .delete(&probe_ns, &DeleteParams::default())
        .await
        .unwrap();
    let mut all = raced.clone();
    all.push(declared);
    every_binding_passed(
        &checked,
        watch,
        &all,
        "their namespace's policy parameters and guard rails were in force",
    )
    .await;
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn additional_quotas_and_network_policies_are_kept_in_every_namespace() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("extra").await;
    let t = format!("{}-t", env.id);
    let (a, b) = (format!("{t}-a"), format!("{t}-b"));
    env.create(
        fixtures::tenant(&t)
            .owner_user("ines")
            .namespaces([&a, &b])
            .additional_quota(NamedQuota {
                scopes: vec!["BestEffort".into()],
                ..fixtures::named_quota("no-best-effort", [("pods", "0")])
            })
            .additional_quota(NamedQuota {
                scope_selector: Some(ScopeSelector {
                    match_expressions: Some(vec![ScopedResourceSelectorRequirement {
                        scope_name: "PriorityClass".into(),
                        operator: "In".into(),
                        values: Some(vec!["high".into()]),
                    }]),
                }),
                ..fixtures::named_quota("high-priority", [("pods", "2")])
            })
            .additional_network_policy(
                "dns-egress",
                NetworkPolicySpec {
                    pod_selector: Some(LabelSelector::default()),
                    policy_types: Some(vec!["Egress".into()]),
                    egress: Some(vec![NetworkPolicyEgressRule {
                        ports: Some(vec![NetworkPolicyPort {
                            protocol: Some("UDP".into()),
                            port: Some(IntOrString::Int(53)),
                            ..NetworkPolicyPort::default()
                        }]),
                        ..NetworkPolicyEgressRule::default()
                    }]),
                    ..NetworkPolicySpec::default()
                },
            ),
    )
    .await;
    env.ready(&t).await;
    for ns in [&a, &b] {
        let quotas = env.api::<ResourceQuota>(ns);
        let best = quotas.get("no-best-effort").await.expect("no-best-effort");
        let spec = best.spec.unwrap();
        assert_eq!(spec.scopes.unwrap(), ["BestEffort"], "{ns}");
        assert_eq!(spec.hard.unwrap()["pods"].0, "0");
        let high = quotas
            .get("high-priority")
            .await
            .expect("high-priority")
            .spec
            .unwrap();
        assert_eq!(
            high.scope_selector.unwrap().match_expressions.unwrap()[0].values,
            Some(vec!["high".to_string()])
        );
        let dns = env
            .api::<NetworkPolicy>(ns)
            .get("dns-egress")
            .await
            .expect("dns-egress")
            .spec
            .unwrap();
        assert_eq!(dns.policy_types.unwrap(), ["Egress"], "{ns}");
    }

    // The BestEffort quota is in force: a pod without requests is refused in the namespace.
    let owner = env.as_user("ines");
    let err = Api::<Pod>::namespaced(owner.clone(), &a)
        .create(&dry_post(), &pod("p"))
        .await
        .expect_err("a BestEffort pod exceeds no-best-effort");
    assert!(err.to_string().contains("no-best-effort"), "{err}");
    // Owners cannot remove them.
    for err in [
        Api::<ResourceQuota>::namespaced(owner.clone(), &a)
            .delete("no-best-effort", &dry_delete())
            .await
            .expect_err("the owner cannot delete the quota"),
        Api::<NetworkPolicy>::namespaced(owner.clone(), &a)
            .delete("dns-egress", &dry_delete())
            .await
            .expect_err("the owner cannot delete the policy"),
    ] {
        assert_eq!(code(&err), Some(403), "{err}");
    }

    // Dropped from the spec, they go; the rest stays.
    env.patch_spec(
        &t,
        json!({"additionalResourceQuotas": [
        {"name": "no-best-effort", "hard": {"pods": "0"}, "scopes": ["BestEffort"]},
    ], "additionalNetworkPolicies": null}),
    )
    .await;
    env.ready(&t).await;
    for ns in [&a, &b] {
        env.gone(&env.api::<ResourceQuota>(ns), "high-priority")
            .await;
        env.gone(&env.api::<NetworkPolicy>(ns), "dns-egress").await;
        env.api::<ResourceQuota>(ns)
            .get("no-best-effort")
            .await
            .expect("kept");
    }
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_deletes_or_orphans_its_namespaces() {
    let _shared = EXCLUSIVE.read().await;
    let mut env = Env::start("del").await;
    let (td, to) = (format!("{}-d", env.id), format!("{}-o", env.id));
    let (d1, d2, o1) = (format!("{td}-1"), format!("{td}-2"), format!("{to}-1"));
    let tenant = |name: &str, nss: Vec<&String>, policy: NamespaceDeletionPolicy| {
        fixtures::tenant(name)
            .owner_user("dave")
            .namespaces(nss)
            .deletion_policy(policy)
            .resource_quota([("pods", "3")])
    };
    env.create(tenant(&td, vec![&d1, &d2], NamespaceDeletionPolicy::Delete))
        .await;
    env.create(tenant(&to, vec![&o1], NamespaceDeletionPolicy::Orphan))
        .await;
    env.ready(&td).await;
    env.ready(&to).await;
    env.api::<ConfigMap>(&o1)
        .create(
            &PostParams::default(),
            &configmap("data", &[], &[("keep", "me")]),
        )
        .await
        .unwrap();

    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    let started = Instant::now();
    env.tenants
        .delete(&td, &DeleteParams::default())
        .await
        .unwrap();
    env.tenant_gone(&td).await;
    env.gone(&namespaces, &d1).await;
    env.gone(&namespaces, &d2).await;
    println!(
        "Delete: Tenant and both namespaces gone after {:?}",
        started.elapsed()
    );

    env.tenants
        .delete(&to, &DeleteParams::default())
        .await
        .unwrap();
    env.tenant_gone(&to).await;
    let kept = namespaces.get(&o1).await.expect("orphaned namespace stays");
    assert!(kept.metadata.deletion_timestamp.is_none());
    assert!(
        !kept.labels().contains_key(TENANT_LABEL),
        "released from the tenant: {:?}",
        kept.labels()
    );
    assert_eq!(
        env.api::<ConfigMap>(&o1)
            .get("data")
            .await
            .unwrap()
            .data
            .unwrap()["keep"],
        "me",
        "contents stay"
    );
    env.gone(&env.api::<RoleBinding>(&o1), "tenant-owner-admin")
        .await;
    env.gone(&env.api::<ResourceQuota>(&o1), "tenant-quota")
        .await;
    env.stop().await;
}

/// `apiserver_request_total` writes (not GET/LIST/WATCH) to the kinds the operator manages.
async fn apiserver_writes(client: &Client) -> (u64, BTreeMap<String, u64>) {
    const KINDS: [&str; 14] = [
        "namespaces",
        "resourcequotas",
        "limitranges",
        "networkpolicies",
        "rolebindings",
        "clusterroles",
        "clusterrolebindings",
        "secrets",
        "configmaps",
        "tenants",
        "validatingadmissionpolicies",
        "validatingadmissionpolicybindings",
        "mutatingadmissionpolicies",
        "mutatingadmissionpolicybindings",
    ];
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.expect("scrape /metrics");
    let mut by = BTreeMap::new();
    let mut total = 0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let get = |k: &str| {
            labels
                .split(&format!("{k}=\""))
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or("")
        };
        let (verb, resource) = (get("verb"), get("resource"));
        if matches!(verb, "GET" | "LIST" | "WATCH" | "CONNECT") || !KINDS.contains(&resource) {
            continue;
        }
        let n = value.parse::<f64>().unwrap_or(0.0) as u64;
        total += n;
        *by.entry(format!("{verb} {resource}")).or_default() += n;
    }
    (total, by)
}

fn diff(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v.saturating_sub(*before.get(k).unwrap_or(&0))))
        .filter(|(_, d)| *d > 0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_tenants_converge_and_a_resync_writes_nothing() {
    let _alone = EXCLUSIVE.write().await;
    let mut env = Env::start("scale").await;
    const N: usize = 100;
    let names: Vec<String> = (0..N).map(|i| format!("{}-{i:03}", env.id)).collect();
    let (w0, by0) = apiserver_writes(&env.client).await;
    let started = Instant::now();
    for name in &names {
        env.create(
            fixtures::tenant(name)
                .owner_user(&format!("owner-{name}"))
                .namespaces([format!("{name}-ns")])
                .resource_quota([("pods", "10"), ("requests.memory", "1Gi")])
                .container_limits([], [("memory", "64Mi")]),
        )
        .await;
    }
    let api = env.tenants.clone();
    let selector = format!("{TEST_LABEL}={}", env.id);
    eventually("100 Tenants Ready", Duration::from_secs(600), || async {
        let list = api
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| e.to_string())?;
        let ready = list
            .items
            .iter()
            .filter(|t| {
                let s = t.status.clone().unwrap_or_default();
                s.observed_generation == t.metadata.generation
                    && s.namespace_count == 1
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
            })
            .count();
        if ready == N {
            Ok(())
        } else {
            Err(format!("{ready}/{N} Ready"))
        }
    })
    .await
    .expect("converged");
    let converged = started.elapsed();
    let (w1, by1) = apiserver_writes(&env.client).await;
    let op_writes = env.operator().writes();
    println!(
        "{N} tenants Ready in {converged:?}; API server writes to managed kinds: {} ({} by the operator's own count)\n  {:?}",
        w1 - w0,
        op_writes,
        diff(&by0, &by1)
    );

    // Resync with nothing changed: a fresh operator (empty caches, every Tenant reconciled on
    // start, then again at its resync) must not write anything. First the control plane's
    // own writes settle (the quota controller's status updates): the counts are read until
    // two reads a second apart agree.
    env.stop().await;
    let (mut w2, mut by2) = apiserver_writes(&env.client).await;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (w, by) = apiserver_writes(&env.client).await;
        if w == w2 {
            break;
        }
        (w2, by2) = (w, by);
    }
    let restarted_at = Instant::now();
    let restarted = start_operator(env.cp, &env.id, Duration::from_secs(5)).await;
    eventually(
        "every Tenant reconciled on start and at the next resync",
        Duration::from_secs(300),
        || async {
            let n = restarted.reconciles("tenant", "success");
            if n >= 2 * N as u64 {
                Ok(())
            } else {
                Err(format!(
                    "{n}/{} reconciles, {} errors, {} skipped",
                    2 * N,
                    restarted.reconciles("tenant", "error"),
                    restarted.reconciles("tenant", "skipped")
                ))
            }
        },
    )
    .await
    .expect("resync");
    let resync_took = restarted_at.elapsed();
    let (w3, by3) = apiserver_writes(&env.client).await;
    let op_writes = restarted.writes();
    println!(
        "restart and resync of {N} tenants ({} reconciles in {resync_took:?} from a cold start, 5 s resync): {} API server writes to managed kinds, {} by the operator's count: {:?}",
        restarted.reconciles("tenant", "success"),
        w3 - w2,
        op_writes,
        diff(&by2, &by3),
    );
    assert_eq!(
        op_writes, 0.0,
        "the operator wrote on a resync with nothing changed"
    );
    assert_eq!(w3 - w2, 0, "writes on resync: {:?}", diff(&by2, &by3));
    restarted.stop().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_at_admission_with_a_clear_message() {
    let _shared = EXCLUSIVE.read().await;
    let cp = steward_testenv::shared().await.expect("control plane");
    cp.apply_crd(&Tenant::crd()).await.expect("Tenant CRD");
    // Raw objects: some bad input cannot even be expressed in the Rust types.
    let api: Api<DynamicObject> =
        Api::all_with(cp.client().unwrap(), &ApiResource::erase::<Tenant>(&()));
    let id = format!("bad-{}", suffix());
    let owner = json!([{"kind": "User", "name": "erin"}]);
    let cases: Vec<(&str, String, Value, &str)> = vec![
        (
            "a name that is not a DNS label",
            format!("{id}.dotted"),
            json!({"owners": owner}),
            "must be a DNS label",
        ),
        (
            "an invalid namespace name",
            format!("{id}-1"),
            json!({"owners": owner, "namespaces": ["Bad_NS"]}),
            "spec.namespaces[0]",
        ),
        (
            "a system namespace",
            format!("{id}-2"),
            json!({"owners": owner, "namespaces": ["kube-system"]}),
            "system namespaces",
        ),
        (
            "a negative quantity",
            format!("{id}-3"),
            json!({"owners": owner, "resourceQuota": {"hard": {"pods": "-1"}}}),
            "must be a non-negative quantity",
        ),
        (
            "a malformed quantity",
            format!("{id}-4"),
            json!({"owners": owner, "tenantQuota": {"hard": {"requests.cpu": "two"}}}),
            "must be a non-negative quantity",
        ),
        (
            "a malformed limit",
            format!("{id}-5"),
            json!({"owners": owner, "limitRange": {"limits": [{"type": "Container", "max": {"memory": "1Gb"}}]}}),
            "must be a non-negative quantity",
        ),
        (
            "an owner of an unknown kind",
            format!("{id}-6"),
            json!({"owners": [{"kind": "Robot", "name": "r2"}]}),
            "supported values: \"User\", \"Group\", \"ServiceAccount\"",
        ),
        (
            "a ServiceAccount without namespace",
            format!("{id}-7"),
            json!({"owners": [{"kind": "ServiceAccount", "name": "ci"}]}),
            "namespace is required for a ServiceAccount",
        ),
        (
            "no owners",
            format!("{id}-8"),
            json!({"owners": []}),
            "spec.owners",
        ),
        (
            "more namespaces than allowed",
            format!("{id}-9"),
            json!({"owners": owner, "namespaces": ["x1", "x2"], "maxNamespaces": 1}),
            "more namespaces than maxNamespaces",
        ),
        (
            "a duplicate namespace",
            format!("{id}-10"),
            json!({"owners": owner, "namespaces": ["x1", "x1"]}),
            "Duplicate value",
        ),
        (
            "an unknown deletion policy",
            format!("{id}-11"),
            json!({"owners": owner, "deletionPolicy": "Shred"}),
            "supported values: \"Orphan\", \"Delete\"",
        ),
        (
            "an operator label in namespaceMetadata",
            format!("{id}-12"),
            json!({"owners": owner, "namespaceMetadata": {"labels": {"tenancy.steward.dev/tenant": "other"}}}),
            "set by the operator",
        ),
        (
            "a wildcard registry",
            format!("{id}-14"),
            json!({"owners": owner, "policies": {"allowedRegistries": ["*"]}}),
            "spec.policies.allowedRegistries[0]",
        ),
        (
            "an empty list of registries",
            format!("{id}-15"),
            json!({"owners": owner, "policies": {"allowedRegistries": []}}),
            "spec.policies.allowedRegistries",
        ),
        (
            "a default RuntimeClass that is not allowed",
            format!("{id}-13"),
            json!({"owners": owner, "policies": {"allowedRuntimeClasses": ["gvisor"], "defaultRuntimeClass": "runc"}}),
            "defaultRuntimeClass must be one of allowedRuntimeClasses",
        ),
    ];
    for (what, name, spec, needle) in cases {
        let t: DynamicObject = serde_json::from_value(json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name}, "spec": spec})).unwrap();
        let err = api
            .create(&PostParams::default(), &t)
            .await
            .expect_err(what);
        assert_eq!(code(&err), Some(422), "{what}: {err}");
        assert!(err.to_string().contains(needle), "{what}: {err}");
        if let kube::Error::Api(s) = &err {
            println!("{what}: {}", s.message);
        }
    }
    // The integer form of a quantity is accepted.
    let ok: DynamicObject = serde_json::from_value(json!({"apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": format!("{id}-ok")}, "spec": {"owners": owner, "resourceQuota": {"hard": {"pods": 10, "requests.memory": "1Gi"}}}})).unwrap();
    api.create(
        &PostParams {
            dry_run: true,
            ..Default::default()
        },
        &ok,
    )
    .await
    .expect("valid tenant accepted");
    // So is the sample.
    let path = steward_testenv::workspace_root().join("deploy/samples/tenant.yaml");
    let sample: DynamicObject =
        serde_yaml::from_str(&std::fs::read_to_string(&path).expect("read the sample"))
            .expect("sample yaml");
    api.create(
        &PostParams {
            dry_run: true,
            ..Default::default()
        },
        &sample,
    )
    .await
    .expect("the sample Tenant is valid");
}
