"""The rehearsal's IAM evaluator on its own, case by case against the IAM User Guide's evaluation rules."""

import pytest
from iampolicy import Request, evaluate

PARAM = "arn:aws:ssm:us-east-1:123456789012:parameter"
STOP = {
    "Effect": "Allow",
    "Action": "ec2:StopInstances",
    "Resource": "arn:aws:ec2:us-east-1:123456789012:instance/*",
    "Condition": {"StringEquals": {"aws:ResourceTag/gpu-cluster:name": "c1"}},
}


def allowed(statements, action, resource="*", **context) -> bool:
    return evaluate([{"Statement": statements}], Request(action, resource, context)).allowed


def test_nothing_is_allowed_without_a_statement_and_an_explicit_deny_wins():
    grant = {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": f"{PARAM}/gpu-cluster/c1/*"}
    deny = {"Effect": "Deny", "Action": "ssm:*", "Resource": f"{PARAM}/gpu-cluster/c1/secret"}
    assert not allowed([], "ssm:GetParameter", f"{PARAM}/gpu-cluster/c1/x")
    assert allowed([grant], "ssm:GetParameter", f"{PARAM}/gpu-cluster/c1/x")
    assert not allowed([grant, deny], "ssm:GetParameter", f"{PARAM}/gpu-cluster/c1/secret")


def test_actions_match_case_insensitively_with_wildcards_and_resources_case_sensitively():
    grant = {"Effect": "Allow", "Action": ["ssm:Get*", "cloudwatch:PutMetric?ata"], "Resource": f"{PARAM}/a/*"}
    assert allowed([grant], "SSM:getparameter", f"{PARAM}/a/b")
    assert allowed([grant], "cloudwatch:PutMetricData", f"{PARAM}/a/b/c")
    assert not allowed([grant], "ssm:PutParameter", f"{PARAM}/a/b")
    assert not allowed([grant], "ssm:GetParameter", f"{PARAM}/A/b")
    assert not allowed([grant], "ssm:GetParameter", f"{PARAM}/ab")  # no implicit prefix match


def test_not_action_and_not_resource_invert_the_match():
    grant = {"Effect": "Allow", "NotAction": "iam:*", "NotResource": f"{PARAM}/ec2/*"}
    assert allowed([grant], "ssm:GetParameter", f"{PARAM}/gpu")
    assert not allowed([grant], "iam:PassRole", f"{PARAM}/gpu")
    assert not allowed([grant], "ssm:GetParameter", f"{PARAM}/ec2/keypair/k")


def test_a_tag_condition_needs_the_tag_on_the_resource():
    instance = "arn:aws:ec2:us-east-1:123456789012:instance/i-1"
    assert allowed([STOP], "ec2:StopInstances", instance, **{"aws:ResourceTag/gpu-cluster:name": "c1"})
    assert not allowed([STOP], "ec2:StopInstances", instance, **{"aws:ResourceTag/gpu-cluster:name": "c2"})
    assert not allowed([STOP], "ec2:StopInstances", instance)  # an untagged instance: the key is missing


def test_if_exists_negation_and_set_qualifiers():
    ns = {"Effect": "Allow", "Action": "cloudwatch:PutMetricData", "Resource": "*"}
    if_exists = dict(ns, Condition={"StringEqualsIfExists": {"cloudwatch:namespace": "A"}})
    assert allowed([if_exists], "cloudwatch:PutMetricData") and not allowed(
        [if_exists], "cloudwatch:PutMetricData", **{"cloudwatch:namespace": "B"}
    )
    not_equals = dict(ns, Condition={"StringNotEquals": {"cloudwatch:namespace": ["A", "B"]}})
    assert allowed([not_equals], "cloudwatch:PutMetricData", **{"cloudwatch:namespace": "C"})
    assert not allowed([not_equals], "cloudwatch:PutMetricData", **{"cloudwatch:namespace": "B"})
    any_value = dict(ns, Condition={"ForAnyValue:StringLike": {"aws:TagKeys": ["gpu-*"]}})
    assert allowed([any_value], "cloudwatch:PutMetricData", **{"aws:TagKeys": ["x", "gpu-cluster:name"]})
    all_values = dict(ns, Condition={"ForAllValues:StringLike": {"aws:TagKeys": ["gpu-*"]}})
    assert not allowed([all_values], "cloudwatch:PutMetricData", **{"aws:TagKeys": ["x", "gpu-cluster:name"]})
    assert allowed([all_values], "cloudwatch:PutMetricData")  # no keys at all: vacuously true (IAM's caveat)


def test_a_policy_variable_in_a_resource_takes_the_requests_value_and_matches_nothing_without_one():
    own = {"Effect": "Allow", "Action": "ssm:TerminateSession", "Resource": "arn:aws:ssm:*:*:session/${aws:username}-*"}
    session = "arn:aws:ssm:us-east-1:123456789012:session/alice-0a1b2c3d"
    assert allowed([own], "ssm:TerminateSession", session, **{"aws:username": "alice"})
    assert not allowed([own], "ssm:TerminateSession", session, **{"aws:username": "bob"})
    assert not allowed([own], "ssm:TerminateSession", session)  # a role's session has no aws:username
    either = dict(own, Resource=[own["Resource"], "arn:aws:ssm:*:*:session/${aws:userid}-*"])
    assert allowed([either], "ssm:TerminateSession", session, **{"aws:userid": "alice"})


def test_what_it_cannot_evaluate_is_refused_not_guessed():
    variable = {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/${aws:username, 'x'}/*"}
    with pytest.raises(ValueError, match="policy variable form"):
        allowed([variable], "s3:GetObject", "arn:aws:s3:::b/u/k")
    in_a_condition = dict(STOP, Condition={"StringEquals": {"aws:ResourceTag/owner": "${aws:username}"}})
    with pytest.raises(ValueError, match="policy variables"):
        allowed(
            [in_a_condition],
            "ec2:StopInstances",
            "arn:aws:ec2:us-east-1:123456789012:instance/i-1",
            **{"aws:ResourceTag/owner": "u"},
        )
    numeric = {
        "Effect": "Allow",
        "Action": "s3:GetObject",
        "Resource": "*",
        "Condition": {"NumericLessThan": {"x": "1"}},
    }
    with pytest.raises(ValueError, match="NumericLessThan"):
        allowed([numeric], "s3:GetObject", "arn:aws:s3:::b/k", x="0")


FSTAB = "fs-1.efs.us-east-1.amazonaws.com:/ /data nfs4 nfsvers=4.1,hard,_netdev,nofail 0 0\n"
MOUNT_TARGET = {"Bool": {"elasticfilesystem:AccessedViaMountTarget": "true"}}


def test_an_anonymous_nfs_mount_needs_client_mount_from_a_statement_for_every_principal():
    from rehearsal import efs_mount_refusals

    every = {"Effect": "Allow", "Principal": {"AWS": "*"}, "Condition": MOUNT_TARGET}
    granted = dict(
        every,
        Action=["elasticfilesystem:ClientMount", "elasticfilesystem:ClientRootAccess", "elasticfilesystem:ClientWrite"],
    )
    # cdk.json's denyAnonymousAccess flag: CDK's own policy without ClientMount (aws-cdk#33669)
    flag = dict(every, Action=["elasticfilesystem:ClientRootAccess", "elasticfilesystem:ClientWrite"])
    role_only = dict(granted, Principal={"AWS": "arn:aws:iam::123456789012:role/node"})
    assert efs_mount_refusals({"FileSystemPolicy": {"Statement": [granted]}}, FSTAB) == []
    assert efs_mount_refusals({}, FSTAB) == []  # no policy: the security group decides
    refused = efs_mount_refusals({"FileSystemPolicy": {"Statement": [flag]}}, FSTAB)
    assert [r.split(":")[1] for r in refused] == ["ClientMount"]
    assert len(efs_mount_refusals({"FileSystemPolicy": {"Statement": [role_only]}}, FSTAB)) == 3  # needs `iam`
