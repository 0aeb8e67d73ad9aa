//! `cargo xtask image <operator>`: an OCI image archive without a container daemon (as `ko`
//! does for Go).
//!
//! The image holds one layer: the release binary at `/usr/local/bin/<operator>`, the shared
//! libraries it links (read from `ldd`: glibc's loader, libc, libm, libgcc_s), an
//! `/etc/passwd` naming the non-root user 65532, and an empty `/tmp`. The archive is an OCI
//! image layout (`oci-layout`, `index.json`, `blobs/sha256/…`) plus a Docker-style
//! `manifest.json`, so both `docker load` and `podman load` accept it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::json;
use sha2::{Digest, Sha256};

/// The operators that have images.
pub const OPERATORS: &[&str] = &[
    "database-operator",
    "tenant-operator",
    "upgrade-orchestrator",
];

/// What was built.
#[derive(Debug)]
pub struct Image {
    pub archive: PathBuf,
    pub reference: String,
    pub binary_size: u64,
    pub archive_size: u64,
}

/// Builds the release binary of `operator` and its image archive under `target/images/`.
pub fn run(operator: &str) -> Result<Image> {
    if !OPERATORS.contains(&operator) {
        bail!(
            "unknown operator {operator:?}; one of {}",
            OPERATORS.join(", ")
        );
    }
    let status = crate::cargo()
        .args(["build", "--release", "--package", operator])
        .status()?;
    if !status.success() {
        bail!("cargo build --release -p {operator} failed");
    }
    let binary = crate::workspace_root()
        .join("target/release")
        .join(operator);
    let out = crate::workspace_root().join("target/images");
    let image = build(&binary, operator, env!("CARGO_PKG_VERSION"), &out)?;
    println!(
        "{}: binary {:.1} MB, image archive {:.1} MB\n  docker load -i {}   (or podman load -i …)",
        image.reference,
        image.binary_size as f64 / 1e6,
        image.archive_size as f64 / 1e6,
        image.archive.display()
    );
    Ok(image)
}

/// Writes `<out>/<name>.oci.tar` for `binary`.
pub fn build(binary: &Path, name: &str, version: &str, out: &Path) -> Result<Image> {
    let binary_size = std::fs::metadata(binary)
        .with_context(|| format!("{} missing", binary.display()))?
        .len();
    let layer_tar = layer(binary, name)?;
    let diff_id = sha256(&layer_tar);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&layer_tar)?;
    let layer_gz = gz.finish()?;
    let reference = format!("steward/{name}:{version}");
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": "65532:65532",
            "Entrypoint": [format!("/usr/local/bin/{name}")],
            "Env": ["PATH=/usr/local/bin"],
            "WorkingDir": "/",
            "Labels": labels(name, version),
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
        "history": [{"created_by": "cargo xtask image"}],
    }))?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", sha256(&config)), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": format!("sha256:{}", sha256(&layer_gz)), "size": layer_gz.len()}],
        "annotations": labels(name, version),
    }))?;
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{}", sha256(&manifest)),
            "size": manifest.len(),
            "annotations": {"io.containerd.image.name": reference, "org.opencontainers.image.ref.name": version},
        }],
    }))?;
    let docker_manifest = serde_json::to_vec(&json!([{
        "Config": format!("blobs/sha256/{}", sha256(&config)),
        "RepoTags": [reference],
        "Layers": [format!("blobs/sha256/{}", sha256(&layer_gz))],
    }]))?;

    std::fs::create_dir_all(out)?;
    let archive = out.join(format!("{name}.oci.tar"));
    let mut tar = tar::Builder::new(std::fs::File::create(&archive)?);
    let mut add = |path: &str, data: &[u8]| -> Result<()> { append(&mut tar, path, data, 0o644) };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json", &index)?;
    add("manifest.json", &docker_manifest)?;
    for blob in [&config, &manifest, &layer_gz] {
        add(&format!("blobs/sha256/{}", sha256(blob)), blob)?;
    }
    tar.into_inner()?.flush()?;
    let archive_size = std::fs::metadata(&archive)?.len();
    Ok(Image {
        archive,
        reference,
        binary_size,
        archive_size,
    })
}

fn labels(name: &str, version: &str) -> serde_json::Value {
    json!({
        "org.opencontainers.image.title": name,
        "org.opencontainers.image.description": format!("Steward {name}"),
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.vendor": "Steward",
    })
}

/// The root filesystem layer (uncompressed tar).
fn layer(binary: &Path, name: &str) -> Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    for dir in ["etc", "tmp", "usr", "usr/local", "usr/local/bin", "lib64"] {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(if dir == "tmp" { 0o1777 } else { 0o755 });
        h.set_size(0);
        h.set_mtime(0);
        h.set_cksum();
        tar.append_data(&mut h, format!("{dir}/"), std::io::empty())?;
    }
    append(&mut tar, "etc/passwd", b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n", 0o644)?;
    append(
        &mut tar,
        "etc/group",
        b"root:x:0:\nnonroot:x:65532:\n",
        0o644,
    )?;
    append(
        &mut tar,
        &format!("usr/local/bin/{name}"),
        &std::fs::read(binary)?,
        0o755,
    )?;
    for lib in shared_libraries(binary)? {
        let rel = lib.strip_prefix("/").unwrap_or(&lib).to_path_buf();
        let real = std::fs::canonicalize(&lib)?;
        append(
            &mut tar,
            &rel.to_string_lossy(),
            &std::fs::read(real)?,
            0o755,
        )?;
    }
    Ok(tar.into_inner()?)
}

/// The absolute paths `ldd` resolves for `binary`.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    Ok(text
        .lines()
        .filter_map(|l| {
            let path = l
                .split("=>")
                .nth(1)
                .unwrap_or(l)
                .split_whitespace()
                .next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

fn append<W: Write>(tar: &mut tar::Builder<W>, path: &str, data: &[u8], mode: u32) -> Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    tar.append_data(&mut h, path, data)?;
    Ok(())
}

fn sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::io::Read;

    use super::*;

    /// Reads every file of a tar archive into memory.
    fn files(tar_bytes: &[u8]) -> HashMap<String, Vec<u8>> {
        let mut out = HashMap::new();
        let mut archive = tar::Archive::new(tar_bytes);
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().to_string();
            let mut data = Vec::new();
            entry.read_to_end(&mut data).unwrap();
            out.insert(path, data);
        }
        out
    }

    fn blob<'a>(files: &'a HashMap<String, Vec<u8>>, descriptor: &serde_json::Value) -> &'a [u8] {
        let digest = descriptor["digest"].as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let data = files
            .get(&format!("blobs/sha256/{hex}"))
            .unwrap_or_else(|| panic!("blob {digest} missing"));
        assert_eq!(sha256(data), hex, "digest of {digest}");
        assert_eq!(
            descriptor["size"].as_u64().unwrap(),
            data.len() as u64,
            "size of {digest}"
        );
        data
    }

    /// Builds an image of a real operator binary, checks every digest of the OCI layout,
    /// extracts the binary with its libraries and runs `--version` through the image's own
    /// dynamic loader.
    #[test]
    fn image_is_a_valid_oci_layout_whose_binary_runs() {
        let operator = "tenant-operator";
        let status = crate::cargo()
            .args(["build", "--quiet", "--package", operator])
            .status()
            .unwrap();
        assert!(status.success());
        let binary = crate::workspace_root().join("target/debug").join(operator);
        let out = tempfile::tempdir().unwrap();
        let image = build(&binary, operator, "0.0.0-test", out.path()).unwrap();

        let files = files(&std::fs::read(&image.archive).unwrap());
        assert_eq!(files["oci-layout"], br#"{"imageLayoutVersion":"1.0.0"}"#);
        let index: serde_json::Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifest: serde_json::Value =
            serde_json::from_slice(blob(&files, &index["manifests"][0])).unwrap();
        let config: serde_json::Value =
            serde_json::from_slice(blob(&files, &manifest["config"])).unwrap();
        assert_eq!(config["config"]["User"], "65532:65532");
        assert_eq!(
            config["config"]["Labels"]["org.opencontainers.image.title"],
            operator
        );
        let layer_gz = blob(&files, &manifest["layers"][0]);
        let mut layer = Vec::new();
        flate2::read::GzDecoder::new(layer_gz)
            .read_to_end(&mut layer)
            .unwrap();
        assert_eq!(
            config["rootfs"]["diff_ids"][0],
            format!("sha256:{}", sha256(&layer))
        );

        let root = tempfile::tempdir().unwrap();
        tar::Archive::new(layer.as_slice())
            .unpack(root.path())
            .unwrap();
        let bin = root.path().join("usr/local/bin").join(operator);
        let loader = root.path().join("lib64/ld-linux-x86-64.so.2");
        let libdir = root.path().join("lib/x86_64-linux-gnu");
        let output = Command::new(&loader)
            .arg("--library-path")
            .arg(&libdir)
            .arg(&bin)
            .arg("--version")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            stdout.contains(operator),
            "version output names the binary: {stdout}"
        );
    }
}
