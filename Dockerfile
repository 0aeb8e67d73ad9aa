# syntax=docker/dockerfile:1
# One image per operator:
#   docker build --build-arg OPERATOR=database-operator -t steward/database-operator:0.1.0 .
#   podman build --build-arg OPERATOR=tenant-operator   -t steward/tenant-operator:0.1.0 .
# OPERATOR is one of database-operator, tenant-operator, upgrade-orchestrator.
# Without a container daemon, `cargo xtask image <operator>` builds an equivalent OCI archive
# (same binary path, same non-root user 65532).

ARG OPERATOR=database-operator

FROM rust:1-bookworm AS build
ARG OPERATOR
WORKDIR /src
COPY . .
# The cache mounts keep the registry and target/ between builds (BuildKit / podman).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p "${OPERATOR}" \
 && install -D -m 0755 "target/release/${OPERATOR}" "/out/${OPERATOR}"

FROM gcr.io/distroless/cc-debian12:nonroot
ARG OPERATOR
COPY --from=build /out/${OPERATOR} /usr/local/bin/operator
USER 65532:65532
# metrics, health probes
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/operator"]
