# kvgate's container image: built with the project's locked dependencies,
# run as a non-root user in a small runtime image, entrypoint `kvgate`.
#
#   docker build -t kvgate --build-arg KVGATE_GIT_COMMIT=$(git rev-parse --short=12 HEAD) .
#   docker build --target symbols -o type=local,dest=out .   # out/kvgate.debug
#
# The binary is optimized with a profile of its own hot path, taken in the
# build stage by running the load tool against an instrumented build
# (deploy/pgo/build.sh, `make release`). It has no debug info in the image;
# its symbols are kept in the `symbols` stage (kvgate.debug, linked by
# .gnu_debuglink) for profiling.
# `make image` builds the same runtime layout here without pulling a base
# image (see deploy/image/build.sh).

FROM rust:1.89-bookworm AS build
WORKDIR /src
# The commit for kvgate_build_info (.git is not in the build context).
ARG KVGATE_GIT_COMMIT=unknown
ENV KVGATE_GIT_COMMIT=${KVGATE_GIT_COMMIT}
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY benches benches
COPY crates crates
COPY vendor vendor
COPY deploy/pgo deploy/pgo
RUN deploy/pgo/build.sh \
 && objcopy --only-keep-debug target/pgo/kvgate /kvgate.debug \
 && objcopy --strip-debug --add-gnu-debuglink=/kvgate.debug target/pgo/kvgate /kvgate

FROM scratch AS symbols
COPY --from=build /kvgate.debug /kvgate.debug

# glibc and libgcc, nothing else; user 65532 (nonroot).
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=build /kvgate /usr/local/bin/kvgate
USER 65532:65532
EXPOSE 50061 9464
ENTRYPOINT ["/usr/local/bin/kvgate"]
CMD ["serve", "--demo", "--listen", "0.0.0.0:50061", "--metrics-listen", "0.0.0.0:9464"]
