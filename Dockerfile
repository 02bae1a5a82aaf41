# syntax=docker/dockerfile:1
# Multi-stage: build a static binary, ship it on a distroless base as non-root.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/ferry ./cmd/ferry

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ferry /usr/local/bin/ferry
USER nonroot:nonroot
# Inside a container loopback is the container's own: listen on every
# interface so the EXPOSEd ports answer. Publish them on the host's loopback
# (compose does) or put them behind a firewall; the admin server logs a
# warning when it listens beyond loopback.
ENV FERRY_HTTP_ADDR=0.0.0.0:8080 \
    FERRY_ADMIN_ADDR=0.0.0.0:9091
EXPOSE 8080 9091
ENTRYPOINT ["/usr/local/bin/ferry"]
CMD ["run", "--migrate"]
