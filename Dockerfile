# syntax=docker/dockerfile:1
# The gateway image (also runs the engine simulator: `warmroute sim`). Two stages: the first installs
# warmroute and its dependencies into /opt/venv; the final image is that venv on the same slim Python,
# without pip, setuptools, compilers or the source tree, running as an unprivileged user.
# Configuration is mounted at run time (/etc/warmroute/gateway.yaml); secrets come from the environment.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A venv without pip of its own: the base image's pip installs into it (--python), so the final image
# carries no installer. Every dependency has a manylinux wheel; nothing is compiled here.
RUN python -m venv --without-pip /opt/venv
COPY pyproject.toml README.md ./
COPY config ./config
COPY routing ./routing
COPY backends ./backends
COPY gateway ./gateway
RUN pip --python /opt/venv/bin/python install --no-cache-dir --no-compile . \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 warmroute \
    && useradd --system --uid 10001 --gid warmroute --no-create-home --shell /usr/sbin/nologin warmroute
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8080
# /healthz answers while the process serves (engines may still be starting: that is /readyz's business).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["warmroute"]
CMD ["serve", "--config", "/etc/warmroute/gateway.yaml"]
