//! Test helpers: the shared control plane, namespaces, CRDs, less privileged clients, waiting.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, Config};
use tokio::sync::OnceCell;

use crate::{ControlPlane, Error, Options};

/// The control plane of this test binary, started on first use and shared by its tests.
///
/// Its processes die with the test process; its temp dir is swept by the next start.
///
/// # Errors
/// The start error, for every caller, if the control plane could not be started: tests
/// fail, they never skip.
pub async fn shared() -> Result<&'static ControlPlane, Error> {
    static SHARED: OnceCell<Result<ControlPlane, String>> = OnceCell::const_new();
    let cp = SHARED
        .get_or_init(|| async {
            ControlPlane::start(Options::default())
                .await
                .map_err(|e| format!("{e}"))
        })
        .await;
    cp.as_ref()
        .map_err(|e| Error::Other(format!("the shared control plane failed to start: {e}")))
}

/// The root of the Steward workspace (for `crds/`, `deploy/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// How long [`eventually`] lets a check that started before its deadline run past it.
pub const CHECK_GRACE: Duration = Duration::from_secs(10);

/// Polls `check` every 100 ms until it returns `Ok`, or fails after `timeout` with `what`
/// and the last `Err` message `check` gave ("3/5 replicas ready").
///
/// A check that does not return is cut off at the deadline too (with at least
/// `CHECK_GRACE` for the first one), so a request that hangs fails the test instead of
/// stalling the run.
///
/// # Errors
/// [`Error::Timeout`].
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no check finished");
    loop {
        let cutoff = deadline.max(Instant::now() + CHECK_GRACE);
        match tokio::time::timeout_at(cutoff.into(), check()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(message)) => last = message,
            Err(_) => {
                last = format!("a check still had not returned at the deadline; before it: {last}");
                break;
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(Error::Timeout {
        what: what.to_string(),
        waited_secs: timeout.as_secs(),
        last,
    })
}

/// Waits until `count` (a counter the test keeps: attempts, writes, calls) reaches `min`:
/// [`eventually`] with the count as its message ("2/3 attempts").
///
/// # Errors
/// [`Error::Timeout`].
pub async fn at_least(
    what: &str,
    min: usize,
    timeout: Duration,
    mut count: impl FnMut() -> usize,
) -> Result<usize, Error> {
    eventually(what, timeout, || {
        let n = count();
        async move {
            if n >= min {
                Ok(n)
            } else {
                Err(format!("{n}/{min}"))
            }
        }
    })
    .await
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Kube { what, source }
}

impl ControlPlane {
    /// Creates a fresh namespace `<prefix>-<random>` labelled `steward.dev/test=<prefix>` and
    /// waits for its `default` ServiceAccount (so Pods can be created in it).
    pub async fn namespace(&self, prefix: &str) -> Result<String, Error> {
        let client = self.client()?;
        let name = format!("{prefix}-{:06x}", rand::random::<u32>() & 0xff_ffff);
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"steward.dev/test": prefix}}
        }))
        .map_err(|e| Error::Other(e.to_string()))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .map_err(kube_err(format!("create namespace {name}")))?;
        let sas: Api<ServiceAccount> = Api::namespaced(client, &name);
        eventually(
            &format!("default ServiceAccount in {name}"),
            Duration::from_secs(30),
            || {
                let sas = sas.clone();
                async move {
                    match sas.get_opt("default").await {
                        Ok(Some(_)) => Ok(()),
                        Ok(None) => Err("not created yet by kube-controller-manager".into()),
                        Err(e) => Err(e.to_string()),
                    }
                }
            },
        )
        .await?;
        Ok(name)
    }

    /// Applies (server-side) every `*.yaml` CRD in `dir` and waits until each is Established.
    pub async fn install_crds(&self, dir: &Path) -> Result<Vec<String>, Error> {
        let mut crds = Vec::new();
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|source| Error::Io {
                what: format!("read {}", dir.display()),
                source,
            })?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file).map_err(|source| Error::Io {
                what: format!("read {}", file.display()),
                source,
            })?;
            let crd: CustomResourceDefinition = serde_yaml::from_str(&text)
                .map_err(|e| Error::Other(format!("{} is not a CRD: {e}", file.display())))?;
            crds.push(crd);
        }
        let mut names = Vec::new();
        for crd in &crds {
            names.push(self.apply_crd(crd).await?);
        }
        Ok(names)
    }

    /// Applies one CRD (server-side, forced) and waits until it is Established.
    pub async fn apply_crd(&self, crd: &CustomResourceDefinition) -> Result<String, Error> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client()?);
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::apply("steward-testenv").force(),
            &Patch::Apply(crd),
        )
        .await
        .map_err(kube_err(format!("apply CRD {name}")))?;
        eventually(
            &format!("CRD {name} Established"),
            Duration::from_secs(30),
            || {
                let api = api.clone();
                let name = name.clone();
                async move {
                    let crd = api.get(&name).await.map_err(|e| e.to_string())?;
                    let established = crd
                        .status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True");
                    if established {
                        Ok(())
                    } else {
                        Err("not Established".into())
                    }
                }
            },
        )
        .await?;
        Ok(name)
    }

    /// A TokenRequest token (valid one hour) for ServiceAccount `namespace/name`, which is
    /// created if it does not exist.
    pub async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<String, Error> {
        let sas: Api<ServiceAccount> = Api::namespaced(self.client()?, namespace);
        if sas
            .get_opt(name)
            .await
            .map_err(kube_err("get ServiceAccount"))?
            .is_none()
        {
            let sa: ServiceAccount =
                serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
                    .map_err(|e| Error::Other(e.to_string()))?;
            sas.create(&PostParams::default(), &sa)
                .await
                .map_err(kube_err("create ServiceAccount"))?;
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..Default::default()
            }),
            ..Default::default()
        };
        sas.create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(kube_err(format!("request a token for {namespace}/{name}")))?
            .status
            .and_then(|s| s.token)
            .ok_or_else(|| Error::Other("TokenRequest returned no token".into()))
    }

    /// The admin configuration, authenticated instead as ServiceAccount `namespace/name`
    /// (see [`ControlPlane::service_account_token`]); for running an operator in-process as
    /// its own ServiceAccount.
    pub async fn service_account_config(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Config, Error> {
        let token = self.service_account_token(namespace, name).await?;
        let mut config: Config = self.config().clone();
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.into()),
            ..Default::default()
        };
        Ok(config)
    }

    /// A client authenticated as ServiceAccount `namespace/name`
    /// (see [`ControlPlane::service_account_config`]).
    pub async fn service_account_client(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Client, Error> {
        let config = self.service_account_config(namespace, name).await?;
        Client::try_from(config).map_err(kube_err("build a ServiceAccount client"))
    }

    /// An admin-authenticated client that impersonates `user` in `groups`
    /// (`system:authenticated` is added by the API server).
    pub fn impersonating_client(&self, user: &str, groups: &[&str]) -> Result<Client, Error> {
        let mut config: Config = self.config().clone();
        config.auth_info.impersonate = Some(user.to_string());
        config.auth_info.impersonate_groups = Some(groups.iter().map(|g| g.to_string()).collect());
        Client::try_from(config).map_err(kube_err("build an impersonating client"))
    }
}
