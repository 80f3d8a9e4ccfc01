"""Issue 19 §20 (ops): the Price List API query names exactly one product and the Spot quota counts
open Spot requests. Pricing and Service Quotas are not emulated by moto: botocore's Stubber with the
real response shapes; EC2 (Spot requests) from the moto server."""

import json

import pytest
from aws_stubs import offline
from botocore.stub import Stubber

from clusterops import cost
from clusterops.aws import quotas


def product(usd: str, sku: str = "ABC", **attributes) -> str:
    """One PriceList item as GetProducts returns it (a JSON string, aws_v1 format)."""
    return json.dumps(
        {
            "product": {"productFamily": "Compute Instance", "sku": sku, "attributes": attributes},
            "serviceCode": "AmazonEC2",
            "terms": {
                "OnDemand": {
                    f"{sku}.JRTCKXETXF": {
                        "priceDimensions": {
                            f"{sku}.JRTCKXETXF.6YS6EN2CT7": {"unit": "Hrs", "pricePerUnit": {"USD": usd}}
                        }
                    }
                }
            },
        }
    )


def test_the_price_query_names_one_on_demand_linux_product():
    """Price List API (AWS Price List user guide, "Filtering" / EC2 attributes): without
    marketoption=OnDemand the query also matches Capacity Block products; without
    operation=RunInstances (plain Linux) it matches the SQL/BYOL variants; licenseModel
    "No License required" drops BYOL. A price is taken only when exactly one product matches."""
    pricing = offline("pricing")
    seen = {}
    pricing.meta.events.register(
        "provide-client-params.pricing.GetProducts",
        lambda params, **kwargs: seen.update({f["Field"]: f["Value"] for f in params["Filters"]}),
    )
    with Stubber(pricing) as stubber:
        stubber.add_response("get_products", {"PriceList": [product("0.7520000000")], "FormatVersion": "aws_v1"})
        assert cost.api_price(pricing, "g4dn.2xlarge", "us-east-1") == 0.752
    assert seen["marketoption"] == "OnDemand"
    assert seen["operation"] == "RunInstances"
    assert seen["licenseModel"] == "No License required"
    assert seen["capacitystatus"] == "Used" and seen["preInstalledSw"] == "NA" and seen["tenancy"] == "Shared"


def test_several_matching_products_are_an_error_not_the_first_one():
    pricing = offline("pricing")
    with Stubber(pricing) as stubber:
        two = [product("0.752", "AAA"), product("1.500", "BBB")]
        stubber.add_response("get_products", {"PriceList": two, "FormatVersion": "aws_v1"})
        with pytest.raises(cost.PricingError, match=r"2 products match g4dn.2xlarge in us-east-1"):
            cost.api_price(pricing, "g4dn.2xlarge", "us-east-1")
    with Stubber(pricing) as stubber:  # and instance_price falls back to the table, saying why
        stubber.add_response("get_products", {"PriceList": two, "FormatVersion": "aws_v1"})
        price = cost.instance_price(pricing, "g4dn.2xlarge", "us-east-1")
    assert price.usd_per_hour == cost.TABLE["instances_usd_per_hour"]["g4dn.2xlarge"]
    assert price.source.startswith("offline table of") and "2 products match" in price.source


def spot_request(request_id, state, instance_type, instance_id=None) -> dict:
    item = {
        "SpotInstanceRequestId": request_id,
        "State": state,
        "Type": "persistent",
        "LaunchSpecification": {"InstanceType": instance_type, "ImageId": "ami-1"},
    }
    return item | ({"InstanceId": instance_id} if instance_id else {})


def test_open_spot_requests_count_against_the_spot_quota():
    """EC2 User Guide, "Spot Instance quotas": the quota is the vCPUs that running Spot Instances use
    "or will use pending the fulfillment of open Spot Instance requests". An active request's
    instance is counted once, as running. moto fulfils a request at once (never "open"): Stubber."""
    ec2 = offline("ec2")
    running = {"InstanceId": "i-1", "InstanceType": "g5.xlarge", "InstanceLifecycle": "spot"}
    with Stubber(ec2) as stubber:
        stubber.add_response("describe_instances", {"Reservations": [{"Instances": [running]}]})
        stubber.add_response(
            "describe_spot_instance_requests",
            {
                "SpotInstanceRequests": [
                    spot_request("sir-1", "active", "g5.xlarge", "i-1"),  # its instance: running above
                    spot_request("sir-2", "open", "g5.2xlarge"),  # 8 vCPUs, G Spot
                    spot_request("sir-3", "open", "m5.large"),  # another bucket
                    spot_request("sir-4", "open", "p4d.24xlarge"),  # another bucket
                ]
            },
            {"Filters": [{"Name": "state", "Values": ["open", "active"]}]},
        )
        assert quotas.running_vcpus(ec2, "g4dn.2xlarge", spot=True) == 4 + 8
        stubber.assert_no_pending_responses()
