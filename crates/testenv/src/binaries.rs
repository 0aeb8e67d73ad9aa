//! Building the control-plane binaries from the Go modules in `crates/testenv/go/`.
//!
//! Each Go module (`etcd`, `kubernetes`, `kwok`, the real node's `containerd` and `coredns`,
//! `helm` for the chart tests, `prometheus` for the monitoring tests where Debian's is not
//! installed, `otelcol` for the trace test) pins its component in `go.mod`/`go.sum`. The
//! backup tests' object store, S3Proxy, is a Java program: its jar comes from Maven Central,
//! pinned by version and SHA-256 ([`s3proxy`]).
//! The binaries land in a cache directory outside the repository, keyed by a hash of the
//! module files, the ldflags and the Go version, so a second run (or CI on the same
//! machine) finds them and starts in seconds. A build goes to a temporary directory and
//! is renamed into place only when complete, so an interrupted build never leaves a
//! half-written cache entry.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::Error;
use crate::images::sha256;

/// Paths of the built control-plane binaries and the versions they were built from.
#[derive(Clone, Debug)]
pub struct Binaries {
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kube_controller_manager: PathBuf,
    pub kube_scheduler: PathBuf,
    /// kubectl, for people trying things by hand against the control plane.
    pub kubectl: PathBuf,
    /// The real node's kubelet (same build as the control plane).
    pub kubelet: PathBuf,
    /// The real node's kube-proxy.
    pub kube_proxy: PathBuf,
    pub kwok: PathBuf,
    /// kwok Stage definitions (node initialize + lease heartbeat, pod ready/complete/delete),
    /// copied from the kwok module at build time.
    pub kwok_stages: PathBuf,
    pub versions: Versions,
}

/// Component versions, read from the Go modules' `go.mod` files.
#[derive(Clone, Debug)]
pub struct Versions {
    pub kubernetes: String,
    pub etcd: String,
    pub kwok: String,
    pub go: String,
}

/// One Go module and the commands it builds.
struct Module {
    dir: &'static str,
    /// The module path whose `require` version names this build.
    pinned: &'static str,
    packages: &'static [&'static str],
    /// Go build tags.
    tags: &'static [&'static str],
    /// Go sources of this module's own main package, hashed with go.mod and go.sum.
    sources: &'static [&'static str],
}

const ETCD: Module = Module {
    dir: "etcd",
    pinned: "go.etcd.io/etcd/server/v3",
    packages: &["go.etcd.io/etcd/server/v3"],
    tags: &[],
    sources: &[],
};
const KUBERNETES: Module = Module {
    dir: "kubernetes",
    pinned: "k8s.io/kubernetes",
    packages: &[
        "k8s.io/kubernetes/cmd/kube-apiserver",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        "k8s.io/kubernetes/cmd/kubectl",
        "k8s.io/kubernetes/cmd/kubelet",
        "k8s.io/kubernetes/cmd/kube-proxy",
    ],
    tags: &[],
    sources: &[],
};
const KWOK: Module = Module {
    dir: "kwok",
    pinned: "sigs.k8s.io/kwok",
    packages: &["sigs.k8s.io/kwok/cmd/kwok"],
    tags: &[],
    sources: &[],
};
const CONTAINERD: Module = Module {
    dir: "containerd",
    pinned: "github.com/containerd/containerd/v2",
    packages: &[
        "github.com/containerd/containerd/v2/cmd/containerd",
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
        "github.com/containerd/containerd/v2/cmd/ctr",
    ],
    // The storage drivers the node does not use (it uses overlayfs) need C libraries.
    tags: &["no_btrfs", "no_devmapper", "no_zfs"],
    sources: &[],
};
/// CoreDNS with only the plugins the node's Corefile uses (`go/coredns/main.go`): 774 Go
/// packages instead of 1 409, a 54 MB binary instead of 80.
const COREDNS: Module = Module {
    dir: "coredns",
    pinned: "github.com/coredns/coredns",
    packages: &["."],
    tags: &[],
    sources: &["main.go"],
};

const HELM: Module = Module {
    dir: "helm",
    pinned: "helm.sh/helm/v4",
    packages: &["helm.sh/helm/v4/cmd/helm"],
    tags: &[],
    sources: &[],
};

const PROMETHEUS: Module = Module {
    dir: "prometheus",
    pinned: "github.com/prometheus/prometheus",
    packages: &[
        "github.com/prometheus/prometheus/cmd/prometheus",
        "github.com/prometheus/prometheus/cmd/promtool",
    ],
    tags: &[],
    sources: &[],
};

const OTELCOL: Module = Module {
    dir: "otelcol",
    pinned: "go.opentelemetry.io/collector/otelcol",
    packages: &["."],
    tags: &[],
    sources: &["main.go"],
};

/// kwok stages to simulate a kubelet: nodes become Ready and heartbeat through Leases,
/// pods become Running/Ready, Job pods complete, deleted pods go away.
const KWOK_STAGES: &[&str] = &[
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
];

/// The directory holding the Go modules.
pub fn go_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("go")
}

/// Where built binaries are cached: `$STEWARD_CACHE_DIR`, else `$XDG_CACHE_HOME/steward`,
/// else `~/.cache/steward`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STEWARD_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("steward");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("steward")
}

/// Builds whatever is missing from the cache and returns the binaries.
///
/// Blocking; a cold build takes 10–20 minutes on 2 cores, a warm call milliseconds.
/// Progress goes to stderr so a person running `cargo xtask test` sees why it waits.
///
/// # Errors
/// [`Error::Build`] naming the component and its build log when `go` fails.
pub fn ensure() -> Result<Binaries, Error> {
    let go = go_version()?;
    let etcd = build(&ETCD, &go, &[])?;
    let k8s_version = required_version(&KUBERNETES)?;
    let kubernetes = build(&KUBERNETES, &go, &kubernetes_ldflags(&k8s_version))?;
    let kwok = build(&KWOK, &go, &[])?;
    let kwok_stages = kwok.join("kwok-stages.yaml");
    Ok(Binaries {
        etcd: etcd.join("server"),
        kube_apiserver: kubernetes.join("kube-apiserver"),
        kube_controller_manager: kubernetes.join("kube-controller-manager"),
        kube_scheduler: kubernetes.join("kube-scheduler"),
        kubectl: kubernetes.join("kubectl"),
        kubelet: kubernetes.join("kubelet"),
        kube_proxy: kubernetes.join("kube-proxy"),
        kwok: kwok.join("kwok"),
        kwok_stages,
        versions: Versions {
            kubernetes: k8s_version,
            etcd: required_version(&ETCD)?,
            kwok: required_version(&KWOK)?,
            go,
        },
    })
}

/// Builds kubernetes (the control plane's servers, the kubelet, kube-proxy, kubectl) unless
/// cached, alone: [`ensure`] builds it with etcd and kwok, which this lets another thread build
/// meanwhile (`cargo xtask test`'s Go workers). Blocking; the longest of the Go builds.
///
/// # Errors
/// As [`ensure`].
pub fn kubernetes() -> Result<(), Error> {
    let version = required_version(&KUBERNETES)?;
    build(&KUBERNETES, &go_version()?, &kubernetes_ldflags(&version)).map(|_| ())
}

/// Builds etcd and kwok unless cached (see [`kubernetes`]).
///
/// # Errors
/// As [`ensure`].
pub fn etcd_and_kwok() -> Result<(), Error> {
    let go = go_version()?;
    build(&ETCD, &go, &[])?;
    build(&KWOK, &go, &[]).map(|_| ())
}

/// Paths of the real node's own binaries (besides kubelet and kube-proxy, which are built with
/// the control plane) and their versions.
#[derive(Clone, Debug)]
pub struct NodeBinaries {
    pub containerd: PathBuf,
    /// `containerd-shim-runc-v2`, which containerd starts per pod.
    pub containerd_shim: PathBuf,
    pub ctr: PathBuf,
    pub coredns: PathBuf,
    /// containerd version (`go.mod` of `go/containerd`).
    pub containerd_version: String,
    /// CoreDNS version (`go.mod` of `go/coredns`).
    pub coredns_version: String,
}

/// Builds containerd (with its runc shim and `ctr`) and CoreDNS unless cached.
///
/// Blocking; about 3 minutes cold on 2 cores, milliseconds warm.
///
/// # Errors
/// [`Error::Build`] naming the component and its build log when `go` fails.
pub fn ensure_node() -> Result<NodeBinaries, Error> {
    let go = go_version()?;
    let containerd = build(&CONTAINERD, &go, &[])?;
    let coredns = build(&COREDNS, &go, &[])?;
    Ok(NodeBinaries {
        containerd: containerd.join("containerd"),
        containerd_shim: containerd.join("containerd-shim-runc-v2"),
        ctr: containerd.join("ctr"),
        coredns: coredns.join("coredns"),
        containerd_version: required_version(&CONTAINERD)?,
        coredns_version: required_version(&COREDNS)?,
    })
}

/// Helm, for the chart's tests (`charts/steward`): built on first use, not with the control
/// plane, since only those tests need it. Blocking; a few minutes cold on 2 cores.
///
/// # Errors
/// [`Error::Build`] naming the log when `go` fails.
pub fn helm() -> Result<PathBuf, Error> {
    let go = go_version()?;
    let version = required_version(&HELM)?;
    let ldflags = [format!(
        "-X helm.sh/helm/v4/internal/version.version={version}"
    )];
    Ok(build(&HELM, &go, &ldflags)?.join("helm"))
}

/// Debian's Prometheus and promtool (package `prometheus`), which `cargo xtask test`
/// installs: the rule syntax, `promtool test rules` and scraping the monitoring tests use are
/// the same there, and a build from Go modules took 4.5 of a cold run's 20 Go minutes.
const DEBIAN_PROMETHEUS: (&str, &str) = ("/usr/bin/prometheus", "/usr/bin/promtool");

/// Prometheus and promtool, for the monitoring tests (`deploy/monitoring`): Debian's when
/// installed (`DEBIAN_PROMETHEUS`), else built from `go/prometheus` on first use (blocking;
/// several minutes cold on 2 cores).
///
/// # Errors
/// [`Error::Build`] naming the log when `go` fails.
pub fn prometheus() -> Result<(PathBuf, PathBuf), Error> {
    let (server, tool) = DEBIAN_PROMETHEUS;
    if Path::new(server).exists() && Path::new(tool).exists() {
        return Ok((PathBuf::from(server), PathBuf::from(tool)));
    }
    let dir = build(&PROMETHEUS, &go_version()?, &[])?;
    Ok((dir.join("prometheus"), dir.join("promtool")))
}

/// An OpenTelemetry Collector with an OTLP receiver and a file exporter (`go/otelcol`), for
/// the trace test: built on first use. Blocking; a few minutes cold on 2 cores.
///
/// # Errors
/// [`Error::Build`] naming the log when `go` fails.
pub fn otelcol() -> Result<PathBuf, Error> {
    Ok(build(&OTELCOL, &go_version()?, &[])?.join("otelcol"))
}

/// The S3Proxy release the backup tests archive to ([`s3proxy`]): Maven Central's
/// `org.gaul:s3proxy`, the jar with its dependencies, and its SHA-256.
pub const S3PROXY: (&str, &str) = (
    "4.1.0",
    "a4d025969aaf796616ed4b1e2491d87d455ce84bb28cb9db086b2e6aaa68b48d",
);

/// S3Proxy (an S3 server; with its `filesystem-nio2` backend, buckets are directories), whose
/// S3 API the PostgreSQL backup tests and `cargo xtask up` archive to: its jar, downloaded from
/// Maven Central on first use (55 MB) and checked against [`S3PROXY`]. It runs on Debian's
/// Java 17, which `cargo xtask` installs with the real node's packages. It replaced a build of
/// SeaweedFS from Go modules, which took 9 of a cold run's 51 minutes on 2 cores.
///
/// # Errors
/// [`Error::Build`] naming the download's log when the download fails or the jar is not the
/// pinned one.
pub fn s3proxy() -> Result<PathBuf, Error> {
    let (version, sha) = S3PROXY;
    let dir = cache_dir().join("s3proxy");
    let jar = dir.join(format!("s3proxy-{version}-jar-with-dependencies.jar"));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        what: format!("create {}", dir.display()),
        source,
    })?;
    let url = format!(
        "https://repo1.maven.org/maven2/org/gaul/s3proxy/{version}/s3proxy-{version}-jar-with-dependencies.jar"
    );
    let log = dir.join("download.log");
    download(&url, sha, &jar, &log).map_err(|reason| Error::Build {
        component: format!("S3Proxy {version} from Maven Central"),
        log,
        reason,
    })?;
    Ok(jar)
}

/// Makes `dest` the file at `url` whose SHA-256 is `sha` unless it already is: downloaded with
/// curl beside it (`.partial`) and renamed into place only once its hash is checked, so an
/// interrupted download never passes for the file. curl's output goes to `log`; `Err` says
/// why in a sentence.
pub(crate) fn download(url: &str, sha: &str, dest: &Path, log: &Path) -> Result<(), String> {
    let built = |d: &Path| std::fs::read(d).is_ok_and(|d| sha256(&d) == sha);
    let lock_err = |what: String, e: std::io::Error| format!("{what}: {e}");
    crate::cache::fill(dest, built, lock_err, || fetch(url, sha, dest, log))
}

/// Downloads `url` into `dest` (under [`crate::cache::fill`]'s lock; [`download`]).
fn fetch(url: &str, sha: &str, dest: &Path, log: &Path) -> Result<(), String> {
    let partial = crate::cache::partial(dest);
    let out = Command::new("curl")
        .args(["-fsSL", "--retry", "3", "--max-time", "600", "-o"])
        .arg(&partial)
        .arg(url)
        .output()
        .map_err(|e| format!("cannot run curl: {e}"))?;
    let _ = std::fs::write(log, [out.stdout, out.stderr].concat());
    if !out.status.success() {
        return Err(format!("curl {url} exited with {}", out.status));
    }
    let data = std::fs::read(&partial).map_err(|e| format!("read {}: {e}", partial.display()))?;
    let got = sha256(&data);
    if got != sha {
        return Err(format!("{url} has SHA-256 {got}, expected {sha}"));
    }
    std::fs::rename(&partial, dest).map_err(|e| format!("rename to {}: {e}", dest.display()))
}

/// The Prometheus Operator release whose `monitoring.coreos.com` CRDs the monitoring test
/// installs (to apply `deploy/monitoring` against their schemas).
pub const PROMETHEUS_OPERATOR: &str = "v0.85.0";

/// The directory of the Prometheus Operator's CRD manifests
/// (`example/prometheus-operator-crd/monitoring.coreos.com_<plural>.yaml`), from its Go module
/// ([`PROMETHEUS_OPERATOR`], checked against the Go checksum database) in the Go module cache:
/// downloaded on first use.
///
/// # Errors
/// [`Error::GoMissing`] without `go`; [`Error::Other`] when the download fails.
pub fn prometheus_operator_crds() -> Result<PathBuf, Error> {
    let module =
        format!("github.com/prometheus-operator/prometheus-operator@{PROMETHEUS_OPERATOR}");
    let out = Command::new("go")
        .args(["mod", "download", "-json", &module])
        .current_dir(std::env::temp_dir())
        .output()
        .map_err(|source| Error::GoMissing { source })?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        Error::Other(format!(
            "go mod download {module}: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    })?;
    let dir = info["Dir"]
        .as_str()
        .map(|d| Path::new(d).join("example/prometheus-operator-crd"))
        .filter(|d| d.is_dir())
        .ok_or_else(|| Error::Other(format!("go mod download {module}: {info}")))?;
    Ok(dir)
}

/// ldflags that make the binaries report their real version (as `make` in kubernetes does).
fn kubernetes_ldflags(version: &str) -> Vec<String> {
    let mut parts = version.trim_start_matches('v').split('.');
    let major = parts.next().unwrap_or("1").to_string();
    let minor = parts.next().unwrap_or("0").to_string();
    let mut flags = Vec::new();
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push(format!("-X {pkg}.gitVersion={version}"));
        flags.push(format!("-X {pkg}.gitMajor={major}"));
        flags.push(format!("-X {pkg}.gitMinor={minor}"));
        flags.push(format!("-X {pkg}.gitTreeState=clean"));
        flags.push(format!("-X {pkg}.buildDate=1970-01-01T00:00:00Z"));
    }
    flags
}

fn go_version() -> Result<String, Error> {
    let out = Command::new("go")
        .args(["env", "GOVERSION"])
        .output()
        .map_err(|source| Error::GoMissing { source })?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The version `go.mod` requires for the module's pinned component.
fn required_version(module: &Module) -> Result<String, Error> {
    let path = go_dir().join(module.dir).join("go.mod");
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        what: format!("read {}", path.display()),
        source,
    })?;
    text.lines()
        .filter_map(|line| {
            let line = line.trim().trim_start_matches("require").trim();
            let mut words = line.split_whitespace();
            (words.next() == Some(module.pinned)).then(|| words.next().map(str::to_string))?
        })
        .next()
        .ok_or_else(|| Error::Build {
            component: module.dir.to_string(),
            log: path,
            reason: format!("go.mod does not require {}", module.pinned),
        })
}

/// Builds one module into its cache directory unless it is already there.
fn build(module: &Module, go: &str, ldflags: &[String]) -> Result<PathBuf, Error> {
    let src = go_dir().join(module.dir);
    let io = |what: String| move |source| Error::Io { what, source };
    let mut hasher = Sha256::new();
    for file in ["go.mod", "go.sum"].iter().chain(module.sources) {
        let path = src.join(file);
        hasher.update(std::fs::read(&path).map_err(io(format!("read {}", path.display())))?);
    }
    hasher.update(go.as_bytes());
    hasher.update(ldflags.join(" ").as_bytes());
    hasher.update(module.tags.join(",").as_bytes());
    let key = hex::encode(&hasher.finalize()[..8]);
    let version = required_version(module)?;
    let dest = cache_dir()
        .join("controlplane")
        .join(format!("{}-{version}-{key}", module.dir));
    let built = |d: &Path| d.join(".complete").exists();
    crate::cache::fill(&dest, built, crate::cache::lock_err, || {
        go_build(module, ldflags, &src, &version, &dest)
    })?;
    Ok(dest)
}

/// Builds `module` from `src` into the cache entry `dest` (under [`crate::cache::fill`]'s lock).
fn go_build(
    module: &Module,
    ldflags: &[String],
    src: &Path,
    version: &str,
    dest: &Path,
) -> Result<(), Error> {
    let io = |what: String| move |source| Error::Io { what, source };
    let parent = cache_dir().join("controlplane");
    std::fs::create_dir_all(&parent).map_err(io(format!("create {}", parent.display())))?;
    let staging = crate::cache::partial(dest);
    std::fs::create_dir_all(&staging).map_err(io(format!("create {}", staging.display())))?;
    let log_path = parent.join(format!("{}-build.log", module.dir));
    let log =
        std::fs::File::create(&log_path).map_err(io(format!("create {}", log_path.display())))?;
    let log_err = log
        .try_clone()
        .map_err(io(format!("open {}", log_path.display())))?;

    eprintln!(
        "steward-testenv: building {} {version} from Go modules (first run only; log: {})",
        module.dir,
        log_path.display()
    );
    let started = std::time::Instant::now();
    let mut ld = vec!["-s".to_string(), "-w".to_string()];
    ld.extend(ldflags.iter().cloned());
    let status = Command::new("go")
        .current_dir(src)
        .arg("build")
        .arg("-trimpath")
        .arg(format!("-ldflags={}", ld.join(" ")))
        .arg(format!("-tags={}", module.tags.join(",")))
        .arg("-o")
        .arg(format!("{}/", staging.display()))
        .args(module.packages)
        .stdout(log)
        .stderr(log_err)
        .status()
        .map_err(|source| Error::GoMissing { source })?;
    if !status.success() {
        return Err(Error::Build {
            component: module.dir.to_string(),
            log: log_path,
            reason: format!("go build exited with {status}"),
        });
    }
    if module.dir == KWOK.dir {
        write_kwok_stages(src, &staging.join("kwok-stages.yaml"), &log_path)?;
    }
    std::fs::write(
        staging.join(".complete"),
        format!("built in {:?}\n", started.elapsed()),
    )
    .map_err(io(format!("write {}", staging.display())))?;
    let _ = std::fs::remove_dir_all(dest);
    std::fs::rename(&staging, dest).map_err(io(format!("rename into {}", dest.display())))?;
    eprintln!(
        "steward-testenv: built {} in {:.0?}",
        module.dir,
        started.elapsed()
    );
    Ok(())
}

/// Concatenates kwok's own stage definitions from the module source.
fn write_kwok_stages(module_src: &Path, dest: &Path, log: &Path) -> Result<(), Error> {
    let out = Command::new("go")
        .current_dir(module_src)
        .args(["list", "-m", "-f", "{{.Dir}}", KWOK.pinned])
        .output()
        .map_err(|source| Error::GoMissing { source })?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let mut all = String::new();
    for stage in KWOK_STAGES {
        let path = dir.join(stage);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::Build {
            component: "kwok".into(),
            log: log.to_path_buf(),
            reason: format!("cannot read kwok stage {}: {e}", path.display()),
        })?;
        all.push_str("---\n");
        all.push_str(&text);
        all.push('\n');
    }
    std::fs::write(dest, all).map_err(|source| Error::Io {
        what: format!("write {}", dest.display()),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_go_mod() {
        assert!(required_version(&KUBERNETES).unwrap().starts_with("v1."));
        assert!(required_version(&ETCD).unwrap().starts_with("v3."));
        assert!(required_version(&KWOK).unwrap().starts_with("v0."));
        assert!(required_version(&CONTAINERD).unwrap().starts_with("v2."));
        assert!(required_version(&COREDNS).unwrap().starts_with("v1."));
    }

    #[test]
    fn ldflags_carry_major_and_minor() {
        let flags = kubernetes_ldflags("v1.37.2").join(" ");
        assert!(flags.contains("k8s.io/component-base/version.gitVersion=v1.37.2"));
        assert!(flags.contains("gitMajor=1"));
        assert!(flags.contains("gitMinor=37"));
    }
}
