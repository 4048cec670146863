"""The shipped job definitions, checked against the vendors' own published models (no account, no network).

Databricks: every job definition (conf/databricks-job.json, conf/databricks-serverless-job.json and each
target of the bundle conf/databricks.yml) goes through databricks-sdk's ``JobSettings`` (the Jobs API
types) and databricks-bundles' ``Job`` and must come back with no field dropped; the bundle goes through
databricks-bundles' own resource loader (``python -m databricks.bundles.build``, what the Databricks CLI
runs for Python-enabled bundles). The CLI itself (a Go binary) is not available here, so ``render``
merges a target into the top-level resources the way the CLI does (tasks by task_key, job clusters by
job_cluster_key) and refuses anything it does not model. Each target equals its JSON file but for the
wheel: the bundle's tasks name the wheel its ``artifacts`` entry builds (``../dist/*.whl``, uploaded by
``bundle deploy``), the JSON files a wheel the user uploaded.

EMR: conf/emr-cluster.json (RunJobFlow), conf/emr-step.json (AddJobFlowSteps) and
conf/emr-serverless-job.json (EMR Serverless StartJobRun) pass botocore's ParamValidator, the check the
AWS SDKs run before sending, and the constraints of the same service model that are left to the service
(enums, maximum lengths, patterns); then moto's EMR creates the cluster, adds the step and reads both
back, and the AWS CLI commands of docs/deploy.md (``aws emr add-steps``, ``aws emr-serverless
start-job-run --cli-input-json``) run against moto.

Runtimes: every runtime the definitions and docs/deploy.md name (EMR release labels, Databricks Runtime
``spark_version`` and serverless ``environment_version``) is one of ``RUNTIMES``, whose Apache Spark is in
``spark_share.spark_versions.SUPPORTED``.
"""
import contextlib
import copy
import fnmatch
import io
import json
import os
import pathlib
import re
import subprocess
import sys

import boto3
import botocore.handlers
import botocore.session
import pytest
import yaml
from awscli.clidriver import create_clidriver
from botocore.validate import ParamValidator
from databricks.bundles.jobs import Job
from databricks.sdk.service.jobs import JobSettings
from moto import mock_aws
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import spark_share
from spark_share.spark_versions import SUPPORTED

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
REGION = "us-east-1"


def load(name):
    return json.loads((CONF / name).read_text())


def differences(expected, actual, path="$"):
    """Where ``actual`` differs from ``expected``: ``dropped``/``added`` keys and list items, ``changed`` values."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for k in expected.keys() - actual.keys():
            yield f"dropped {path}.{k}"
        for k in actual.keys() - expected.keys():
            yield f"added {path}.{k}"
        for k in expected.keys() & actual.keys():
            yield from differences(expected[k], actual[k], f"{path}.{k}")
    elif isinstance(expected, list) and isinstance(actual, list):
        for i, (e, a) in enumerate(zip(expected, actual)):
            yield from differences(e, a, f"{path}[{i}]")
        for i in range(len(actual), len(expected)):
            yield f"dropped {path}[{i}]"
        for i in range(len(expected), len(actual)):
            yield f"added {path}[{i}]"
    elif expected != actual or type(expected) is not type(actual):
        yield f"changed {path}: {expected!r} -> {actual!r}"


# --- Databricks -----------------------------------------------------------------------------------
BUNDLE = CONF / "databricks.yml"
TARGET_JSON = {"classic": "databricks-job.json", "serverless": "databricks-serverless-job.json"}
# The placeholders of the JSON files, as bundle variable values: rendered with them, a target is its JSON
# file (but for the wheel). The runtime versions are the variables' defaults, real names in both.
PLACEHOLDERS = {"git_url": "https://github.com/<your-org>/spark-share"}
# The wheel a task installs: the bundle's built artifact (a local path, which `bundle deploy` uploads and
# rewrites), the JSON files' wheel uploaded by hand (the Jobs API uploads nothing).
BUILT_WHEEL = "../dist/*.whl"
UPLOADED_WHEEL = f"/Volumes/<catalog>/<schema>/libs/spark_share-{spark_share.__version__}-py3-none-any.whl"
TOP_KEYS = {"bundle", "variables", "resources", "targets", "include", "workspace", "artifacts", "sync",
            "permissions", "run_as", "presets", "experimental", "python", "scripts"}
TARGET_KEYS = {"default", "mode", "variables", "resources", "workspace", "presets", "artifacts", "sync",
               "permissions", "run_as", "git", "bundle", "cluster_id", "compute_id"}
MERGE_KEYS = {"tasks": "task_key", "job_clusters": "job_cluster_key"}  # sequences the CLI merges by key
VAR = re.compile(r"\$\{var\.([A-Za-z0-9_-]+)\}")


def merge(base, over, path="resources"):
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v, f"{path}.{k}") if k in base else v
        return out
    key = MERGE_KEYS.get(path.rsplit(".", 1)[-1])
    if key and isinstance(base, list) and isinstance(over, list):
        out = {item[key]: item for item in base}
        for item in over:
            out[item[key]] = merge(out[item[key]], item, f"{path}[{item[key]}]") if item[key] in out else item
        return list(out.values())
    if isinstance(base, (dict, list)) or isinstance(over, (dict, list)):
        raise AssertionError(f"{path}: set both at the top level and in the target; render() does not model that merge")
    return over


def render(bundle, target, values=None, resolve=True):
    """The bundle's configuration for ``target``: resources merged, variables checked (and substituted)."""
    assert set(bundle) <= TOP_KEYS, f"unknown top-level keys {set(bundle) - TOP_KEYS}"
    assert not {"include", "python", "experimental"} & set(bundle), "render() does not model include/python"
    tgt = bundle["targets"][target] or {}
    assert set(tgt) <= TARGET_KEYS, f"unknown keys in targets.{target}: {set(tgt) - TARGET_KEYS}"
    declared = bundle.get("variables", {})
    assigned = {k: (v.get("default") if isinstance(v, dict) else v)
                for k, v in {**{k: d.get("default") for k, d in declared.items()}, **tgt.get("variables", {}),
                             **(values or {})}.items()}
    assert set(assigned) <= set(declared), f"values for undeclared variables {set(assigned) - set(declared)}"
    missing = {k for k, v in assigned.items() if v is None}
    assert not missing, f"no value assigned to required variables {sorted(missing)} (target {target})"
    resources = merge(bundle.get("resources", {}), tgt.get("resources", {}))

    def sub(node):
        if isinstance(node, dict):
            return {k: sub(v) for k, v in node.items()}
        if isinstance(node, list):
            return [sub(v) for v in node]
        if isinstance(node, str):
            for name in VAR.findall(node):
                assert name in declared, f"${{var.{name}}} is not declared under variables"
            return VAR.sub(lambda m: str(assigned[m.group(1)]), node) if resolve else node
        return node

    return sub(resources), {k: {**declared[k], "value": v} for k, v in assigned.items()}


@pytest.fixture(scope="module")
def bundle():
    return yaml.safe_load(BUNDLE.read_text())


def definitions(with_wheel=False):
    """Every Databricks job definition (as pytest params): the JSON files, and each target of the bundle
    rendered; with ``with_wheel``, each with the wheel its task must install."""
    bundle = yaml.safe_load(BUNDLE.read_text())
    out = [(name, load(name), UPLOADED_WHEEL) for name in TARGET_JSON.values()]
    for target in bundle["targets"]:
        (job,) = render(bundle, target, PLACEHOLDERS)[0]["jobs"].values()
        out.append((f"databricks.yml:{target}", job, BUILT_WHEEL))
    return [pytest.param(job, *([wheel] if with_wheel else []), id=name) for name, job, wheel in out]


def wheels(job):
    """The wheels a job installs: its tasks' ``whl`` libraries and its environments' ``.whl`` dependencies."""
    return [lib["whl"] for task in job["tasks"] for lib in task.get("libraries", []) if "whl" in lib] + [
        dep for env in job.get("environments", []) for dep in env["spec"].get("dependencies", [])
        if dep.endswith(".whl")]


def with_wheel(job, wheel):
    """``job`` with every wheel it installs replaced by ``wheel``."""
    job = copy.deepcopy(job)
    for task in job["tasks"]:
        for lib in task.get("libraries", []):
            if "whl" in lib:
                lib["whl"] = wheel
    for env in job.get("environments", []):
        deps = env["spec"].get("dependencies", [])
        deps[:] = [wheel if dep.endswith(".whl") else dep for dep in deps]
    return job


@pytest.mark.parametrize("job", definitions())
def test_databricks_job_survives_the_sdk_jobs_types(job):
    assert list(differences(job, JobSettings.from_dict(job).as_dict())) == []


@pytest.mark.parametrize("job", definitions())
def test_databricks_job_survives_the_bundle_job_type(job):
    assert list(differences(job, Job.from_dict(job).as_dict())) == []


def test_round_trip_reports_a_dropped_field():
    job = load("databricks-job.json")
    job["max_concurent_runs"] = 1
    job["tasks"][0]["spark_python_task"]["python_fle"] = "jobs/queue_to_table.py"
    job["git_source"]["git_provider"] = "github"  # the enum is gitHub
    assert sorted(differences(job, JobSettings.from_dict(job).as_dict())) == [
        "dropped $.git_source.git_provider", "dropped $.max_concurent_runs",
        "dropped $.tasks[0].spark_python_task.python_fle"]
    with pytest.raises(ValueError, match="Unexpected field 'max_concurent_runs'"):
        Job.from_dict(job)


@pytest.mark.parametrize("target", TARGET_JSON)
def test_each_bundle_target_is_its_json_job(bundle, target):
    """The same job but for the wheel: the bundle installs the wheel it built, the JSON file one uploaded."""
    (job,) = render(bundle, target, PLACEHOLDERS)[0]["jobs"].values()
    expected = load(TARGET_JSON[target])
    assert (wheels(job), wheels(expected)) == ([BUILT_WHEEL], [UPLOADED_WHEEL])
    assert list(differences(with_wheel(expected, "<wheel>"), with_wheel(job, "<wheel>"))) == []


def test_bundle_builds_the_wheel_its_tasks_install(bundle):
    """The bundle's one artifact is the wheel of this repository, built into the directory the tasks'
    BUILT_WHEEL names, and that path lies inside the sync root (the CLI refuses a local library outside
    it: the sync root is the innermost directory holding the bundle root and every ``sync.paths``)."""
    ((_, artifact),) = bundle["artifacts"].items()
    assert artifact["type"] == "whl" and set(artifact) == {"type", "path", "build"}
    project = (CONF / artifact["path"]).resolve()
    assert project == ROOT and (project / "pyproject.toml").is_file()
    build = re.fullmatch(r"python -m pip wheel --no-deps -w (\S+) \.", artifact["build"])
    assert build, artifact["build"]  # --no-deps: the project's wheel only, none of its requirements, in dist/
    assert BUILT_WHEEL == f"{artifact['path']}/{build[1]}/*.whl"
    assert fnmatch.fnmatch(UPLOADED_WHEEL.rsplit("/", 1)[1], BUILT_WHEEL.rsplit("/", 1)[1])
    sync_paths = [(CONF / p).resolve() for p in bundle.get("sync", {}).get("paths", [])]
    sync_root = os.path.commonpath([CONF, *sync_paths])
    assert (CONF / BUILT_WHEEL).resolve().is_relative_to(sync_root), f"{BUILT_WHEEL} is outside the sync root"


def test_bundle_placeholders_are_variables(bundle):
    """No ``<...>`` left in the resources (descriptions aside); every variable declared is used, and
    each target leaves exactly the variables it uses to the user."""
    def strings(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from strings(v, k)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v, key)
        elif isinstance(node, str) and key != "description":
            yield node
    everything = [*strings(bundle["resources"]),
                  *(s for target in bundle["targets"].values() for s in strings(target["resources"]))]
    assert [s for s in everything if re.search(r"<[^>]*>", s)] == []
    used = {name for s in everything for name in VAR.findall(s)}
    assert used == set(bundle["variables"])
    for target in bundle["targets"]:  # the runtime versions have defaults (checked below); the Git URL is yours
        with pytest.raises(AssertionError, match="no value assigned to required variables") as e:
            render(bundle, target)
        assert str(["git_url"]) in str(e.value)
        render(bundle, target, {"git_url": "x"})


def test_render_refuses_what_it_does_not_model(bundle):
    broken = copy.deepcopy(bundle)
    broken["targets"]["classic"]["resources"]["jobs"]["orders_queue_to_table"]["git_source"] = {"git_branch": "dev"}
    render(broken, "classic", PLACEHOLDERS)  # a map merges key by key
    broken["targets"]["classic"]["resources"]["jobs"]["orders_queue_to_table"]["tasks"][0]["libraries"] = [{"whl": "x"}]
    broken["resources"]["jobs"]["orders_queue_to_table"]["tasks"][0]["libraries"] = [{"whl": "y"}]
    with pytest.raises(AssertionError, match=r"tasks\[drain_orders\]\.libraries: set both"):
        render(broken, "classic", PLACEHOLDERS)
    with pytest.raises(AssertionError, match="unknown top-level keys"):
        render({**bundle, "varibles": {}}, "classic", PLACEHOLDERS)
    typo = copy.deepcopy(bundle)
    typo["resources"]["jobs"]["orders_queue_to_table"]["git_source"]["git_url"] = "${var.git_ulr}"
    with pytest.raises(AssertionError, match=r"\$\{var.git_ulr\} is not declared"):
        render(typo, "classic", PLACEHOLDERS)


def bundles_loader(tmp_path, config):
    """databricks-bundles' loader, run as the Databricks CLI runs it: every resource of the bundle's
    configuration is loaded into the package's types (strict: an unknown field is an error) and written back."""
    paths = {name: tmp_path / f"{name}.json" for name in ("input", "output", "diagnostics", "locations")}
    paths["input"].write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "databricks.bundles.build", "--phase", "apply_mutators",
                          *(a for name, p in paths.items() for a in (f"--{name}", str(p)))],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    diagnostics = [json.loads(line) for line in paths["diagnostics"].read_text().splitlines()]
    output = json.loads(paths["output"].read_text())
    return run.returncode, diagnostics, output


def cli_config(bundle, target):
    """The configuration the CLI hands to databricks-bundles: the target selected, variables unresolved."""
    resources, variables = render(bundle, target, PLACEHOLDERS, resolve=False)
    return {"bundle": {**bundle["bundle"], "target": target}, "variables": variables, "resources": resources}


@pytest.mark.parametrize("target", TARGET_JSON)
def test_bundle_loads_with_the_databricks_bundles_loader(bundle, tmp_path, target):
    config = cli_config(bundle, target)
    assert "${var.git_url}" in json.dumps(config["resources"])  # typed as databricks.bundles Variable
    rc, diagnostics, output = bundles_loader(tmp_path, config)
    assert (rc, diagnostics) == (0, [])
    assert list(differences(config["resources"], output["resources"])) == []


def test_bundles_loader_reports_a_misspelled_field(bundle, tmp_path):
    config = cli_config(bundle, "classic")
    config["resources"]["jobs"]["orders_queue_to_table"]["job_clusters"][0]["new_cluster"]["num_worker"] = 2
    rc, diagnostics, _ = bundles_loader(tmp_path, config)
    assert rc == 1 and [d["severity"] for d in diagnostics] == ["error"]
    assert "Unexpected field 'num_worker'" in diagnostics[0]["detail"] + diagnostics[0]["summary"]
    assert diagnostics[0]["path"] == "resources.jobs.orders_queue_to_table"


@pytest.mark.parametrize("job, wheel", definitions(with_wheel=True))
def test_job_definitions_point_at_files_that_exist(job, wheel):
    (task,) = job["tasks"]
    py = task["spark_python_task"]
    assert (ROOT / py["python_file"]).is_file() and (ROOT / py["parameters"][1]).is_file()
    assert wheels(job) == [wheel]  # BUILT_WHEEL: test_bundle_builds_the_wheel_its_tasks_install


# --- EMR ------------------------------------------------------------------------------------------
EMR_DEFINITIONS = {  # operation -> (service, parameters as the SDK call gets them)
    "RunJobFlow": ("emr", lambda: load("emr-cluster.json")),
    "AddJobFlowSteps": ("emr", lambda: {"JobFlowId": "j-EXAMPLE", "Steps": load("emr-step.json")}),
    "StartJobRun": ("emr-serverless", lambda: load("emr-serverless-job.json")),
}


@pytest.fixture(autouse=True)
def no_aws_account(monkeypatch, tmp_path):
    """moto and botocore without real credentials or configuration."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def operation_model(operation):
    service = EMR_DEFINITIONS[operation][0]
    client = botocore.session.get_session().create_client(service, region_name=REGION)
    return client.meta.service_model.operation_model(operation)


def sdk_validation(operation, params):
    """botocore's own check before sending: the idempotency token filled in, then ParamValidator."""
    model = operation_model(operation)
    params = copy.deepcopy(params)
    botocore.handlers.generate_idempotent_uuid(params, model)
    return ParamValidator().validate(params, model.input_shape).generate_report()


def service_constraints(shape, value, path="$"):
    """The constraints of the service model that botocore leaves to the service: enum values, maximum
    lengths and sizes, patterns (those Python's ``re`` can compile)."""
    md = shape.metadata
    if shape.type_name == "structure":
        for k, v in value.items():
            if k in shape.members:
                yield from service_constraints(shape.members[k], v, f"{path}.{k}")
    elif shape.type_name in ("list", "map"):
        if "max" in md and len(value) > md["max"]:
            yield f"{path}: more than {md['max']} items"
        items, member = (value.items(), shape.value) if shape.type_name == "map" else (enumerate(value), shape.member)
        for k, v in items:
            yield from service_constraints(member, v, f"{path}[{k!r}]")
    elif shape.type_name == "string":
        if shape.enum and value not in shape.enum:
            yield f"{path}: {value!r} is not one of {shape.enum}"
        if "max" in md and len(value) > md["max"]:
            yield f"{path}: longer than {md['max']}"
        if "pattern" in md:
            try:
                pattern = re.compile(md["pattern"])
            except re.error:  # Java-only syntax (e.g. surrogate ranges): the service checks it
                return
            if not pattern.fullmatch(value):
                yield f"{path}: {value!r} does not match {md['pattern']}"
    elif shape.type_name in ("integer", "long") and "max" in md and value > md["max"]:
        yield f"{path}: above {md['max']}"


@pytest.mark.parametrize("operation", EMR_DEFINITIONS)
def test_emr_definition_passes_botocore_validation(operation):
    params = EMR_DEFINITIONS[operation][1]()
    assert sdk_validation(operation, params) == ""
    assert list(service_constraints(operation_model(operation).input_shape, params)) == []


@pytest.mark.parametrize("operation, break_it, message", [
    ("RunJobFlow", lambda p: p["Instances"].update(KeepJobFlowAliveWhenNoStep=False),
     'Unknown parameter in Instances: "KeepJobFlowAliveWhenNoStep"'),
    ("AddJobFlowSteps", lambda p: p["Steps"][0].update(ActionOnFailur="CONTINUE"),
     'Unknown parameter in Steps[0]: "ActionOnFailur"'),
    ("StartJobRun", lambda p: p["jobDriver"]["sparkSubmit"].update(entryPointArgs=[]),
     'Unknown parameter in jobDriver.sparkSubmit: "entryPointArgs"'),
    ("StartJobRun", lambda p: p.pop("executionRoleArn"), 'Missing required parameter in input: "executionRoleArn"'),
], ids=["RunJobFlow-misspelled", "AddJobFlowSteps-misspelled", "StartJobRun-misspelled", "StartJobRun-missing"])
def test_botocore_validation_reports_a_broken_definition(operation, break_it, message):
    params = EMR_DEFINITIONS[operation][1]()
    break_it(params)
    assert message in sdk_validation(operation, params)


@pytest.mark.parametrize("operation, break_it, message", [
    ("AddJobFlowSteps", lambda p: p["Steps"][0].update(ActionOnFailure="CONTINUE_ON_ERROR"),
     "$.Steps[0].ActionOnFailure: 'CONTINUE_ON_ERROR' is not one of"),
    ("StartJobRun", lambda p: p.update(executionRoleArn="spark-share-job-runtime-role"),
     "$.executionRoleArn: 'spark-share-job-runtime-role' does not match arn:"),
    ("StartJobRun", lambda p: p.update(applicationId="<your-application-id>"),
     "$.applicationId: '<your-application-id>' does not match"),
], ids=["ActionOnFailure-enum", "executionRoleArn-pattern", "applicationId-pattern"])
def test_service_constraints_report_a_broken_definition(operation, break_it, message):
    params = EMR_DEFINITIONS[operation][1]()
    break_it(params)
    assert sdk_validation(operation, params) == ""  # botocore lets these through; the service would not
    assert any(e.startswith(message) for e in service_constraints(operation_model(operation).input_shape, params))


def test_emr_cluster_runs_the_shipped_step_with_the_shipped_bootstrap():
    cluster = load("emr-cluster.json")
    assert cluster["Steps"] == load("emr-step.json")  # the cluster definition carries the step unchanged
    assert {"Name": "Spark"} in cluster["Applications"]  # its ReleaseLabel: test_runtime_is_supported
    (bootstrap,) = cluster["BootstrapActions"]
    script = bootstrap["ScriptBootstrapAction"]
    assert script["Path"].endswith("/spark-share/conf/emr-bootstrap.sh") and (CONF / "emr-bootstrap.sh").is_file()
    assert script["Args"] == [f"s3://<your-bucket>/spark-share/spark_share-{spark_share.__version__}-py3-none-any.whl"]


def step_view(step):
    """A step as AddJobFlowSteps takes it, from ListSteps/DescribeStep's answer."""
    return {"Name": step["Name"], "ActionOnFailure": step["ActionOnFailure"],
            "HadoopJarStep": {"Jar": step["Config"]["Jar"], "Args": step["Config"]["Args"]}}


@mock_aws
def test_emr_cluster_and_step_on_moto():
    cluster, steps = load("emr-cluster.json"), load("emr-step.json")
    emr = boto3.client("emr", region_name=REGION)
    cluster_id = emr.run_job_flow(**cluster)["JobFlowId"]  # as docs/deploy.md submits it
    described = emr.describe_cluster(ClusterId=cluster_id)["Cluster"]
    assert (described["Name"], described["ReleaseLabel"]) == (cluster["Name"], cluster["ReleaseLabel"])
    assert [a["Name"] for a in described["Applications"]] == ["Spark"]
    groups = {g["InstanceGroupType"]: g for g in emr.list_instance_groups(ClusterId=cluster_id)["InstanceGroups"]}
    assert {role: (g["InstanceType"], g["RequestedInstanceCount"]) for role, g in groups.items()} == {
        g["InstanceRole"]: (g["InstanceType"], g["InstanceCount"]) for g in cluster["Instances"]["InstanceGroups"]}
    (action,) = emr.list_bootstrap_actions(ClusterId=cluster_id)["BootstrapActions"]
    (expected,) = cluster["BootstrapActions"]
    assert (action["Name"], action["ScriptPath"], action["Args"]) == (
        expected["Name"], expected["ScriptBootstrapAction"]["Path"], expected["ScriptBootstrapAction"]["Args"])

    (step_id,) = emr.add_job_flow_steps(JobFlowId=cluster_id, Steps=steps)["StepIds"]  # as on a running cluster
    listed = emr.list_steps(ClusterId=cluster_id)["Steps"]  # newest first
    assert [step_view(s) for s in reversed(listed)] == cluster["Steps"] + steps
    assert step_view(emr.describe_step(ClusterId=cluster_id, StepId=step_id)["Step"]) == steps[0]


def aws_cli(*argv):
    """The AWS CLI in this process (so moto answers it): exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = create_clidriver().main([*argv, "--output", "json"])
    return rc, out.getvalue(), err.getvalue()


@mock_aws
def test_emr_step_with_the_aws_cli_on_moto():
    """`aws emr add-steps` takes its own step shape, not AddJobFlowSteps': docs/deploy.md converts
    conf/emr-step.json with jq; this is the same mapping."""
    steps = load("emr-step.json")
    cluster_id = boto3.client("emr", region_name=REGION).run_job_flow(**load("emr-cluster.json"))["JobFlowId"]
    rc, _, err = aws_cli("emr", "add-steps", "--cluster-id", cluster_id, "--steps", f"file://{CONF / 'emr-step.json'}")
    assert rc != 0 and 'Unknown parameter in [0]: "HadoopJarStep"' in err
    cli_steps = [{"Type": "CUSTOM_JAR", "Name": s["Name"], "ActionOnFailure": s["ActionOnFailure"],
                  "Jar": s["HadoopJarStep"]["Jar"], "Args": s["HadoopJarStep"]["Args"]} for s in steps]
    rc, out, err = aws_cli("emr", "add-steps", "--cluster-id", cluster_id, "--steps", json.dumps(cli_steps))
    assert rc == 0, err
    (step_id,) = json.loads(out)["StepIds"]
    emr = boto3.client("emr", region_name=REGION)
    assert step_view(emr.describe_step(ClusterId=cluster_id, StepId=step_id)["Step"]) == steps[0]


def test_emr_serverless_job_runs_the_job_file_with_the_emr_config():
    job = load("emr-serverless-job.json")
    submit = job["jobDriver"]["sparkSubmit"]
    assert submit["entryPoint"].endswith("/spark-share/jobs/queue_to_table.py")
    assert submit["entryPointArguments"] == ["--config", "conf/emr.json"] and (CONF / "emr.json").is_file()
    confs = dict(c.split("=", 1) for c in re.findall(r"--conf (\S+)", submit["sparkSubmitParameters"]))
    archives = dict(a.rsplit("#", 1)[::-1] for a in confs["spark.archives"].split(","))
    assert set(archives) == {"environment", "conf"}  # the packed venv, and conf/ (--config conf/emr.json)
    for name in ("spark.emr-serverless.driverEnv.PYSPARK_DRIVER_PYTHON",
                 "spark.emr-serverless.driverEnv.PYSPARK_PYTHON", "spark.executorEnv.PYSPARK_PYTHON"):
        assert confs[name] == "./environment/bin/python"
    # Every ${env:NAME} of conf/emr.json reaches the driver from Secrets Manager, never in clear text.
    (defaults,) = job["configurationOverrides"]["applicationConfiguration"]
    assert defaults["classification"] == "spark-defaults"
    env = {k.rsplit(".", 1)[1]: v for k, v in defaults["properties"].items()
           if k.startswith("spark.emr-serverless.driverEnv.")}
    assert set(env) == set(re.findall(r"\$\{env:(\w+)\}", (CONF / "emr.json").read_text()))
    assert all(v.startswith("EMR.secret@") for v in env.values())


@mock_aws
def test_emr_serverless_start_job_run_with_the_aws_cli_on_moto():
    job = load("emr-serverless-job.json")
    serverless = boto3.client("emr-serverless", region_name=REGION)
    # moto accepts only labels of the form emr-<major>.<minor>.0 and refuses emr-spark-8.0.0, the release
    # docs/deploy.md creates the application with (test_runtime_is_supported checks that one); the job run
    # itself names no release, so moto's own (Spark 3.5) label stands in for it here only.
    app = serverless.create_application(name="spark-share", releaseLabel="emr-7.0.0", type="SPARK")["applicationId"]
    rc, out, err = aws_cli("emr-serverless", "start-job-run", "--cli-input-json",  # as docs/deploy.md runs it
                           f"file://{CONF / 'emr-serverless-job.json'}", "--application-id", app)
    assert rc == 0, err
    run = serverless.get_job_run(applicationId=app, jobRunId=json.loads(out)["jobRunId"])["jobRun"]
    assert (run["name"], run["executionRole"]) == (job["name"], job["executionRoleArn"])
    assert run["jobDriver"] == job["jobDriver"]
    assert run["configurationOverrides"] == job["configurationOverrides"]


# --- Runtimes -------------------------------------------------------------------------------------
# The runtimes the definitions may name, with the Apache Spark each ships (the vendors' release notes),
# by kind: EMR release label, Databricks Runtime spark_version, serverless environment_version. A name
# matches a key as a glob. A name not here fails test_runtime_is_supported: add it with its Spark.
RUNTIMES = {
    "emr": {
        "emr-spark-8.0.0": "4.0.2",  # EC2, EKS and Serverless
        "emr-7.*": "3.5",
    },
    "databricks": {
        "17.3.x-scala2.13": "4.0.0",  # 17.3 LTS
        "16.4.x-scala2.12": "3.5",  # 16.4 LTS
    },
    "databricks-serverless": {
        "5": "4.1.0",  # Databricks Connect 18
        "4": "4.0.0",  # Databricks Connect 17.3
        "3": "3.5",
        "2": "3.5",  # 3.5 or older
        "1": "3.5",  # 3.5 or older
    },
}
DEPLOY_DOC = ROOT / "docs" / "deploy.md"


def runtime_spark(kind, name):
    """The Spark version the runtime ``name`` ships; AssertionError if it is unknown or not supported."""
    spark = [v for pattern, v in RUNTIMES[kind].items() if fnmatch.fnmatchcase(str(name), pattern)]
    assert spark, f"unknown {kind} runtime {name!r}: add it to RUNTIMES with the Spark its release notes give"
    assert Version(spark[0]) in SpecifierSet(SUPPORTED), (
        f"{kind} runtime {name!r} ships Spark {spark[0]}, outside spark-share's range {SUPPORTED}")
    return spark[0]


def runtimes_named():
    """(kind, name, where) for every runtime the definitions and docs/deploy.md name."""
    out = [("emr", load("emr-cluster.json")["ReleaseLabel"], "emr-cluster.json:ReleaseLabel")]
    doc, bundle = DEPLOY_DOC.read_text(), yaml.safe_load(BUNDLE.read_text())
    out += [("emr", label, "deploy.md:--release-label")
            for label in re.findall(r"--release-label[ =]([^\s\"'`]+)", doc)]
    for var, kind in (("spark_version", "databricks"), ("environment_version", "databricks-serverless")):
        out += [(kind, value, f"deploy.md:{var}=") for value in re.findall(rf"\b{var}=([^\s,\"'`]+)", doc)]
        default = bundle["variables"][var].get("default")
        out.append((kind, None if default is None else str(default), f"databricks.yml:variables.{var}.default"))
        out += [(kind, str(value), f"databricks.yml:targets.{target}.variables.{var}")
                for target, tgt in bundle["targets"].items()
                for value in [(tgt.get("variables") or {}).get(var)] if value is not None]
    for param in definitions():
        (job,), where = param.values, param.id
        out += [("databricks", c["new_cluster"]["spark_version"], f"{where}:spark_version")
                for c in job.get("job_clusters", [])]
        out += [("databricks-serverless", e["spec"]["environment_version"], f"{where}:environment_version")
                for e in job.get("environments", [])]
    return out


def test_every_definition_names_a_runtime():
    """Each definition names its runtime (a real one, not a placeholder or a variable without default)."""
    named = runtimes_named()
    assert all(name is not None for _, name, _ in named), [where for _, name, where in named if name is None]
    assert {where for _, _, where in named} >= {
        "emr-cluster.json:ReleaseLabel", "deploy.md:--release-label",
        "databricks.yml:variables.spark_version.default", "databricks.yml:variables.environment_version.default",
        "databricks-job.json:spark_version", "databricks-serverless-job.json:environment_version",
        "databricks.yml:classic:spark_version", "databricks.yml:serverless:environment_version"}


@pytest.mark.parametrize("kind, name", [pytest.param(kind, name, id=f"{where}={name}")
                                        for kind, name, where in runtimes_named()])
def test_runtime_is_supported(kind, name):
    runtime_spark(kind, name)


@pytest.mark.parametrize("kind, name, message", [
    ("emr", "emr-7.12.0", r"ships Spark 3\.5, outside spark-share's range"),
    ("databricks", "16.4.x-scala2.12", r"ships Spark 3\.5, outside"),
    ("databricks-serverless", "3", r"ships Spark 3\.5, outside"),
    ("emr", "emr-spark-9.0.0", "unknown emr runtime"),
    ("databricks", "<a Databricks Runtime with Apache Spark >= 4.2>", "unknown databricks runtime"),
    ("databricks-serverless", "17.3.x-scala2.13", "unknown databricks-serverless runtime"),
])
def test_runtime_check_refuses_an_unsupported_or_unknown_runtime(kind, name, message):
    with pytest.raises(AssertionError, match=message):
        runtime_spark(kind, name)
