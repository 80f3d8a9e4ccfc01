"""The deploy rehearsal's gate: an HTTP endpoint between AWS clients (the real AWS CLI, boto3) and the moto
server that authorizes every call as IAM would, then forwards it.

Each caller is a principal: the credentials of a deployed role (assumed through moto's STS) or of a policy
document (the laptop's user policy). Every request names its action (the SigV4 signing scope plus the
protocol's operation) and its resources (RESOURCES below: an action without a rule there fails the test,
so a new call cannot slip through unauthorized). A denied call answers AccessDenied, as AWS would, and is
recorded as a violation. Calls moto does not implement go to stand-ins (ec2:GetEbsDefaultKmsKeyId answers a new
account's AWS managed key): cloudformation:SignalResource checks
every name against the deployed stack (the logical ID exists, is an AWS::EC2::Instance with a creation
policy, and is the signalling node's own resource); Session Manager's StartSession answers for an instance
that exists (a session named after its user, as AWS names them), TerminateSession and ResumeSession for a
session it started."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

import boto3
import botocore.exceptions
from botocore.parsers import RpcV2CBORParser
from iampolicy import Request, evaluate

ACCOUNT, REGION = "123456789012", "us-east-1"
IAM_PREFIX = {"monitoring": "cloudwatch", "servicequotas": "servicequotas", "elasticfilesystem": "elasticfilesystem"}


@dataclass
class Principal:
    name: str
    documents: list[dict]
    instance_id: Optional[str] = None  # a node's own instance (the signal must name its resource)
    user: bool = False  # an IAM user (the laptop's): its name is the request's aws:username

    def context(self) -> dict:
        """The request context keys IAM sets from the principal (for policy variables)."""
        return {"aws:username": self.name} if self.user else {"aws:userid": f"AROAREHEARSAL:{self.instance_id}"}


@dataclass(frozen=True)
class Call:
    principal: str
    action: str
    resources: tuple[str, ...]
    allowed: bool
    reason: str
    params: dict = field(default_factory=dict, compare=False, hash=False)


# ---------------------------------------------------------------- what a request is


def _signing(headers) -> tuple[str, str]:
    """(access key id, signing service) from a SigV4 Authorization header."""
    auth = headers.get("Authorization", "")
    credential = auth.split("Credential=", 1)[1].split(",", 1)[0] if "Credential=" in auth else ""
    parts = credential.split("/")
    return (parts[0], parts[3]) if len(parts) >= 5 else ("", "")


def _operation(method: str, path: str, headers, body: bytes, service: str) -> tuple[str, dict]:
    """The operation's name and its parameters, whatever the protocol."""
    target = headers.get("X-Amz-Target")
    if target:  # JSON protocols (ssm, service quotas, pricing)
        return target.rsplit(".", 1)[1], json.loads(body or b"{}")
    if "/operation/" in path:  # smithy RPC v2 CBOR (CloudWatch)
        params = RpcV2CBORParser().parse_data_item(io.BytesIO(body)) if body else {}
        return path.rsplit("/operation/", 1)[1], params
    if service == "s3":
        return _s3_operation(method, path)
    if service == "elasticfilesystem":
        return _efs_operation(method, path)
    form = urllib.parse.parse_qs(body.decode() if body else urllib.parse.urlsplit(path).query)
    params = {k: v[0] for k, v in form.items()}
    return params.pop("Action", "?"), params


def _s3_operation(method: str, path: str) -> tuple[str, dict]:
    parts = urllib.parse.unquote(urllib.parse.urlsplit(path).path).lstrip("/").split("/", 1)
    bucket, key = parts[0], parts[1] if len(parts) > 1 else ""
    operation = {"GET": "GetObject", "HEAD": "GetObject", "PUT": "PutObject", "DELETE": "DeleteObject"}[method]
    if not key:
        operation = {"GET": "ListBucket", "HEAD": "ListBucket"}.get(method, operation + "Bucket")
    return operation, {"Bucket": bucket, "Key": key}


def _efs_operation(method: str, path: str) -> tuple[str, dict]:
    split = urllib.parse.urlsplit(path)
    query = {k: v[0] for k, v in urllib.parse.parse_qs(split.query).items()}
    if method == "GET" and split.path.rstrip("/").endswith("/file-systems"):
        return "DescribeFileSystems", query
    return f"{method} {split.path}", query


def _listed(params: dict, prefix: str) -> list[str]:
    """Query-protocol lists: InstanceId.1, InstanceId.2, ..."""
    return [v for k, v in sorted(params.items()) if k == prefix or k.startswith(prefix + ".")]


# ---------------------------------------------------------------- which resources a call acts on


def _arn(service: str, resource: str, region: str = REGION) -> str:
    return f"arn:aws:{service}:{region}:{ACCOUNT}:{resource}"


# moto refuses parameter names under /aws: the deploys' stand-in for the public DLAMI parameter is
# authorized under the public one's name, in AWS's own account-less ARN form.
ALIASES = {
    "/test/dlami/ami-id": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
}


def _parameter(params: dict) -> list[tuple[str, dict]]:
    names = [ALIASES.get(n, n) for n in params.get("Names") or [params["Name"]]]
    return [
        (
            f"arn:aws:ssm:{REGION}::parameter{n}"
            if n.startswith("/aws/")
            else _arn("ssm", "parameter/" + n.lstrip("/")),
            {},
        )
        for n in names
    ]


def _instances(gate: "Gate", params: dict) -> list[tuple[str, dict]]:
    ids = _listed(params, "InstanceId")
    tags = gate.instance_tags(ids)
    return [
        (_arn("ec2", f"instance/{i}"), {f"aws:ResourceTag/{k}": v for k, v in tags.get(i, {}).items()}) for i in ids
    ]


def _anything(_gate, _params) -> list[tuple[str, dict]]:
    return [("*", {})]


def _session_start(gate: "Gate", params: dict) -> list[tuple[str, dict]]:
    """StartSession acts on the target instance (its tags as ssm:resourceTag/ and aws:ResourceTag/ keys)
    and on the session document: AWS's own (AWS-*) have an account-less ARN; without --document-name the CLI
    starts the account's SSM-SessionManagerRunShell (Session Manager User Guide, "Start a session with a
    document by specifying the session documents in IAM policies")."""
    target = params["Target"]
    tags = gate.instance_tags([target]).get(target, {})
    context = {f"{prefix}/{k}": v for k, v in tags.items() for prefix in ("ssm:resourceTag", "aws:ResourceTag")}
    document = params.get("DocumentName", "SSM-SessionManagerRunShell")
    owner = "" if document.startswith("AWS-") else ACCOUNT
    return [(_arn("ec2", f"instance/{target}"), context), (f"arn:aws:ssm:{REGION}:{owner}:document/{document}", {})]


def _session(_gate, params: dict) -> list[tuple[str, dict]]:
    return [(_arn("ssm", f"session/{params['SessionId']}"), {})]


Rule = Callable[["Gate", dict], list[tuple[str, dict]]]
# Service Authorization Reference: each action's resource types and condition keys, for the calls made here.
RESOURCES: dict[str, Rule] = {
    "sts:GetCallerIdentity": _anything,  # needs no permission; listed so that it is known
    "ssm:GetParameter": lambda g, p: _parameter(p),
    "ssm:GetParameters": lambda g, p: _parameter(p),
    "ssm:PutParameter": lambda g, p: _parameter(p),
    "ssm:StartSession": _session_start,
    "ssm:TerminateSession": _session,
    "ssm:ResumeSession": _session,
    "s3:GetObject": lambda g, p: [(f"arn:aws:s3:::{p['Bucket']}/{p['Key']}", {})],
    "s3:ListBucket": lambda g, p: [(f"arn:aws:s3:::{p['Bucket']}", {})],
    "cloudformation:SignalResource": lambda g, p: [(g.stack_arn(p["StackName"]), {})],
    "cloudformation:DescribeStacks": lambda g, p: [(g.stack_arn(p["StackName"]) if "StackName" in p else "*", {})],
    "cloudformation:ListStackResources": lambda g, p: [(g.stack_arn(p["StackName"]), {})],
    "cloudformation:DescribeStackResources": lambda g, p: [(g.stack_arn(p["StackName"]), {})],
    "cloudwatch:PutMetricData": lambda g, p: [("*", {"cloudwatch:namespace": p.get("Namespace", "")})],
    "cloudwatch:GetMetricStatistics": _anything,
    "cloudwatch:GetMetricData": _anything,
    "cloudwatch:ListMetrics": _anything,
    "cloudwatch:DescribeAlarms": _anything,
    "cloudwatch:SetAlarmState": lambda g, p: [(_arn("cloudwatch", f"alarm:{p['AlarmName']}"), {})],
    "ec2:DescribeInstances": _anything,
    "ec2:DescribeInstanceStatus": _anything,
    "ec2:DescribeSpotInstanceRequests": _anything,
    "ec2:DescribeSpotPriceHistory": _anything,
    "ec2:DescribeInstanceTypes": _anything,
    "ec2:DescribeInstanceTypeOfferings": _anything,
    "ec2:DescribeVolumes": _anything,
    "ec2:DescribeAddresses": _anything,
    "ec2:DescribeSnapshots": _anything,
    "ec2:DescribeSecurityGroups": _anything,
    "ec2:GetEbsDefaultKmsKeyId": _anything,
    "ec2:StopInstances": _instances,
    "ec2:StartInstances": _instances,
    "ec2:CancelSpotInstanceRequests": lambda g, p: [
        (_arn("ec2", f"spot-instances-request/{r}"), {}) for r in _listed(p, "SpotInstanceRequestId")
    ],
    "elasticfilesystem:DescribeFileSystems": _anything,
    "servicequotas:GetServiceQuota": lambda g, p: [
        (f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:{p['ServiceCode']}/{p['QuotaCode']}", {})
    ],
    "servicequotas:RequestServiceQuotaIncrease": lambda g, p: [
        (f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:{p['ServiceCode']}/{p['QuotaCode']}", {})
    ],
    "servicequotas:GetAWSDefaultServiceQuota": lambda g, p: [
        (f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:{p['ServiceCode']}/{p['QuotaCode']}", {})
    ],
    # preflight's dry run: RunInstances' resources are many (instance, image, subnet, group, volume, key
    # pair, network interface); the user policy grants it on "*" (docs/operations.md says why).
    "ec2:RunInstances": _anything,
    "pricing:GetProducts": _anything,
    "tag:GetResources": _anything,
}


def rule_for(action: str) -> Rule | None:
    """The action's rule; read-only Describe*/List* calls, which take no resource-level scoping in EC2,
    CloudFormation's list calls and most others, act on "*"."""
    operation = action.split(":", 1)[1]
    return RESOURCES.get(action) or (_anything if operation.startswith(("Describe", "List")) else None)


# ---------------------------------------------------------------- the gate


class Gate:
    """Authorizes, records, forwards. `principals` maps an access key id to its principal."""

    def __init__(self, moto_endpoint: str, admin: boto3.session.Session):
        self.moto = urllib.parse.urlsplit(moto_endpoint)
        self.admin = admin
        self.principals: dict[str, Principal] = {}
        self.calls: list[Call] = []
        self.violations: list[str] = []
        self.signals: list[dict] = []
        self.sessions: list[str] = []  # Session Manager sessions started through the gate
        self._lock = threading.Lock()

    # --- principals
    def assume(self, role_name: str, instance_id: Optional[str] = None) -> dict:
        """Credentials of a deployed role, as a node's instance profile hands them out; its policies as
        deployed (inline and managed) are what every call with them is checked against."""
        documents = self.role_documents(role_name)
        role = self.admin.client("iam").get_role(RoleName=role_name)["Role"]
        credentials = self.admin.client("sts").assume_role(RoleArn=role["Arn"], RoleSessionName=instance_id or "x")
        keys = credentials["Credentials"]
        self.principals[keys["AccessKeyId"]] = Principal(role_name, documents, instance_id)
        return {
            "AWS_ACCESS_KEY_ID": keys["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": keys["SecretAccessKey"],
            "AWS_SESSION_TOKEN": keys["SessionToken"],
        }

    def role_documents(self, role_name: str) -> list[dict]:
        """The role's policies as IAM holds them after the deploy: inline and managed."""
        iam = self.admin.client("iam")
        documents = [
            iam.get_role_policy(RoleName=role_name, PolicyName=n)["PolicyDocument"]
            for n in iam.list_role_policies(RoleName=role_name)["PolicyNames"]
        ]
        for attached in iam.list_attached_role_policies(RoleName=role_name)["AttachedPolicies"]:
            policy = iam.get_policy(PolicyArn=attached["PolicyArn"])["Policy"]
            version = iam.get_policy_version(PolicyArn=attached["PolicyArn"], VersionId=policy["DefaultVersionId"])
            documents.append(version["PolicyVersion"]["Document"])
        return [_decoded(d) for d in documents]

    def user(self, name: str, documents: list[dict]) -> dict:
        """Credentials for a principal with these identity policies (the laptop user's)."""
        key = f"AKIAUSER{len(self.principals):012d}"
        self.principals[key] = Principal(name, documents, user=True)
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": "user-secret"}

    # --- lookups in the deployed world (as the admin, outside the gate)
    def stack_arn(self, name_or_id: str) -> str:
        stack = self.admin.client("cloudformation").describe_stacks(StackName=name_or_id)["Stacks"][0]
        return stack["StackId"]

    def physical_id(self, stack: str, logical_id: str) -> str:
        summaries = self.admin.client("cloudformation").list_stack_resources(StackName=stack)["StackResourceSummaries"]
        return next(r["PhysicalResourceId"] for r in summaries if r["LogicalResourceId"] == logical_id)

    def instance_tags(self, ids: list[str]) -> dict[str, dict[str, str]]:
        """Each existing instance's tags (one that does not exist is left out)."""
        try:
            found = self.admin.client("ec2").describe_instances(InstanceIds=ids)["Reservations"] if ids else []
        except botocore.exceptions.ClientError as error:
            if error.response["Error"]["Code"] != "InvalidInstanceID.NotFound":
                raise
            found = []
        return {
            i["InstanceId"]: {t["Key"]: t["Value"] for t in i.get("Tags", [])} for r in found for i in r["Instances"]
        }

    # --- one request
    def authorize(self, principal: Principal, action: str, params: dict) -> Call:
        rule = rule_for(action)
        if rule is None:
            call = Call(principal.name, action, (), False, "the rehearsal has no resource rule for it", params)
        else:
            targets = rule(self, params)
            requests = [Request(action, arn, {**principal.context(), **ctx}) for arn, ctx in targets]
            decisions = [evaluate(principal.documents, request) for request in requests]
            denied = [d.reason for d in decisions if not d.allowed]
            allowed = not denied or action == "sts:GetCallerIdentity"
            reason = "; ".join(denied) or decisions[0].reason
            call = Call(principal.name, action, tuple(a for a, _ in targets), allowed, reason, params)
        with self._lock:
            self.calls.append(call)
            if not call.allowed:
                self.violations.append(f"{call.principal}: {action} {list(call.resources)}: {call.reason}")
        return call

    def forward(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, list, bytes]:
        connection = http.client.HTTPConnection(self.moto.hostname, self.moto.port, timeout=60)
        headers = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection")}
        headers["Host"] = self.moto.netloc
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, [(k, v) for k, v in response.getheaders() if k.lower() != "transfer-encoding"], data

    @contextlib.contextmanager
    def serving(self):
        """The gate's endpoint URL while the block runs."""
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


def _decoded(document) -> dict:
    return json.loads(urllib.parse.unquote(document)) if isinstance(document, str) else document


# ---------------------------------------------------------------- the stand-in for SignalResource


def signal_resource(gate: Gate, principal: Principal, params: dict) -> Optional[str]:
    """What CloudFormation checks, and the rehearsal adds: the resource waits for this node's signal."""
    cloudformation = gate.admin.client("cloudformation")
    template = cloudformation.get_template(StackName=params["StackName"])["TemplateBody"]
    template = json.loads(template) if isinstance(template, str) else template
    logical_id = params.get("LogicalResourceId", "")
    resource = template["Resources"].get(logical_id)
    if resource is None:
        return f"Resource {logical_id} does not exist for stack {params['StackName']}"
    if resource["Type"] != "AWS::EC2::Instance" or "ResourceSignal" not in resource.get("CreationPolicy", {}):
        return f"{logical_id} is a {resource['Type']} that waits for no signal"
    own = gate.physical_id(params["StackName"], logical_id)
    if principal.instance_id and own != principal.instance_id:
        return f"{principal.instance_id} signalled {logical_id}, which is {own}"
    if params.get("Status") not in ("SUCCESS", "FAILURE") or not params.get("UniqueId"):
        return f"a signal needs Status SUCCESS or FAILURE and a UniqueId: {params}"
    gate.signals.append({"instance": principal.instance_id, **params})
    return None


SIGNAL_OK = (
    b'<SignalResourceResponse xmlns="http://cloudformation.amazonaws.com/doc/2010-05-15/">'
    b"<ResponseMetadata><RequestId>rehearsal</RequestId></ResponseMetadata></SignalResourceResponse>"
)


EBS_DEFAULT_KEY = (
    b'<GetEbsDefaultKmsKeyIdResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>rehearsal'
    b"</requestId><kmsKeyId>arn:aws:kms:" + f"{REGION}:{ACCOUNT}".encode() + b":alias/aws/ebs</kmsKeyId>"
    b"</GetEbsDefaultKmsKeyIdResponse>"
)


# ---------------------------------------------------------------- the stand-in for Session Manager

SESSION_ACTIONS = ("ssm:StartSession", "ssm:TerminateSession", "ssm:ResumeSession")
JSON_1_1 = "application/x-amz-json-1.1"


def session_manager(gate: Gate, principal: Principal, action: str, params: dict) -> tuple[int, dict]:
    """Session Manager's answer (moto has none): a session id begins with the user's name (Session Manager
    User Guide, "Step 3: Control session access to managed nodes", session ID ARN formats)."""
    if action != "ssm:StartSession":
        known = params.get("SessionId") in gate.sessions
        return (200, {"SessionId": params["SessionId"]}) if known else (400, {"__type": "DoesNotExistException"})
    if not gate.instance_tags([params["Target"]]):
        return 400, {"__type": "TargetNotConnected", "message": f"{params['Target']} is not connected."}
    session_id = f"{principal.name}-{len(gate.sessions):017x}"
    gate.sessions.append(session_id)
    stream = f"wss://ssmmessages.{REGION}.amazonaws.com/v1/data-channel/{session_id}?role=publish_subscribe"
    return 200, {"SessionId": session_id, "TokenValue": "rehearsal-token", "StreamUrl": stream}


def _error(code: str, message: str, json_protocol: bool) -> bytes:
    if json_protocol:
        return json.dumps({"__type": code, "message": message}).encode()
    return (
        f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error>"
        f"<RequestId>rehearsal</RequestId></ErrorResponse>"
    ).encode()


def _handler(gate: Gate):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _serve(self):
            try:
                self._gate()
            except (BrokenPipeError, ConnectionResetError):
                # The client gave up waiting before the answer (botocore's read timeout on a loaded machine:
                # a CI run's "Broken pipe") and retries on a new connection: no fault of the rehearsal's.
                self.close_connection = True
            except Exception as error:  # a fault of the rehearsal itself: fail the test, answer the client
                gate.violations.append(f"the gate failed on {self.command} {self.path}: {error!r}")
                self._reply(500, _error("InternalFailure", repr(error), False))

        def _gate(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            key, service = _signing(self.headers)
            principal = gate.principals.get(key)
            operation, params = _operation(self.command, self.path, self.headers, body, service)
            action = f"{IAM_PREFIX.get(service, service)}:{operation}"
            json_protocol = bool(self.headers.get("X-Amz-Target"))
            if principal is None:
                gate.violations.append(f"{action} by unknown credentials {key!r}")
                return self._reply(403, _error("InvalidClientTokenId", "unknown credentials", json_protocol))
            if not gate.authorize(principal, action, params).allowed:
                message = f"{principal.name} is not authorized to perform: {action}"
                return self._reply(403, _error("AccessDenied", message, json_protocol))
            if action == "cloudformation:SignalResource":
                refused = signal_resource(gate, principal, params)
                if refused:
                    gate.violations.append(f"{principal.name}: SignalResource refused: {refused}")
                    return self._reply(400, _error("ValidationError", refused, False))
                return self._reply(200, SIGNAL_OK, [("Content-Type", "text/xml")])
            if action == "ec2:GetEbsDefaultKmsKeyId":  # moto has none: a new account's, AWS managed
                return self._reply(200, EBS_DEFAULT_KEY, [("Content-Type", "text/xml")])
            if action in SESSION_ACTIONS:
                status, answer = session_manager(gate, principal, action, params)
                return self._reply(
                    status, json.dumps(answer).encode(), [("Content-Type", "application/x-amz-json-1.1")]
                )
            status, headers, data = gate.forward(self.command, self.path, dict(self.headers), body)
            self._reply(status, data, headers)

        def _reply(self, status: int, data: bytes, headers: Optional[list] = None):
            self.send_response(status)
            for name, value in headers or [("Content-Type", "text/xml")]:
                if name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve

    return Handler


def user_data(admin: boto3.session.Session, instance_id: str) -> str:
    """An instance's user data as EC2 holds it."""
    attribute = admin.client("ec2").describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(attribute["UserData"]["Value"]).decode()


# ---------------------------------------------------------------- EFS: the mount a node makes


def efs_mount_refusals(file_system: dict, fstab: str, data_dir: str = "/data") -> list[str]:
    """What EFS would refuse the mount of `data_dir` that `fstab` holds, by the deployed file system's
    policy (AWS EFS User Guide, "Using IAM to control file system data access"): a client without the
    `iam` option is anonymous, so only statements for every principal apply; root needs ClientRootAccess,
    writes ClientWrite, and every mount ClientMount."""
    line = next(f.split() for f in fstab.splitlines() if len(f.split()) > 3 and f.split()[1] == data_dir)
    options = set(line[3].split(","))
    policy = file_system.get("FileSystemPolicy")
    if policy is None:  # no policy: EFS allows every NFS client the mount target's network lets in
        return []
    anonymous = "iam" not in options
    statements = [
        s for s in policy["Statement"] if not anonymous or s.get("Principal") in ("*", {"AWS": "*"}, {"AWS": ["*"]})
    ]
    context = {
        "elasticfilesystem:AccessedViaMountTarget": "true",
        "aws:SecureTransport": "true" if "tls" in options else "false",
    }
    needed = ["ClientMount", "ClientRootAccess"] + ([] if "ro" in options else ["ClientWrite"])
    refused = []
    for action in needed:
        decision = evaluate([{"Statement": statements}], Request(f"elasticfilesystem:{action}", "*", context))
        if not decision.allowed:
            refused.append(f"elasticfilesystem:{action}: {decision.reason}")
    return refused
