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
    companions=""; \
    if [ "${OPERATOR}" = database-operator ]; then companions="steward-pg-instance steward-pooler"; fi; \
    cargo build --release --locked -p "${OPERATOR}" $(for c in $companions; do echo "-p $c"; done) \
 && install -D -m 0755 "target/release/${OPERATOR}" /out/operator \
 && for c in $companions; do install -D -m 0755 "target/release/$c" "/out/$c"; done

FROM gcr.io/distroless/cc-debian12:nonroot
ARG OPERATOR
# The operator, and the database-operator's companions, which its pods copy from this image:
# the PostgreSQL instance manager (steward-pg-instance) and the pooler agent (steward-pooler).
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
# metrics, health probes
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/operator"]
