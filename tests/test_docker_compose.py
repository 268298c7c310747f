"""docker-compose.yml cannot run here (no Docker engine); check that it matches the app."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    return yaml.safe_load((ROOT / name).read_text())


def test_compose_runs_kafka_in_kraft_mode_a_worker_and_prometheus():
    services = load("docker-compose.yml")["services"]
    assert set(services) == {"kafka", "worker", "prometheus"}
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:4.")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"


def test_worker_command_and_broker_address_match_the_app():
    services = load("docker-compose.yml")["services"]
    worker = services["worker"]
    assert worker["command"] == ["faust", "-A", "app", "worker", "-l", "info"]
    internal = [a for a in services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split(",")
                if a.startswith("INTERNAL://")][0]
    assert worker["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == internal.removeprefix("INTERNAL://")
    assert (ROOT / "app.py").exists() and "from streams.service import app" in (ROOT / "app.py").read_text()


def test_prometheus_scrapes_the_worker_metrics_port():
    worker = load("docker-compose.yml")["services"]["worker"]
    port = worker["environment"]["SWITCHYARD_WEB_PORT"]
    assert worker["environment"]["SWITCHYARD_WEB_BIND"] == "0.0.0.0"  # reachable by Prometheus
    assert f"127.0.0.1:{port}:{port}" in worker["ports"]              # but not by the world
    job = load("deploy/prometheus.yml")["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"worker:{port}"]


def test_service_reads_the_environment_the_compose_file_sets():
    source = (ROOT / "streams" / "service.py").read_text()
    for name in load("docker-compose.yml")["services"]["worker"]["environment"]:
        assert name in source, name
