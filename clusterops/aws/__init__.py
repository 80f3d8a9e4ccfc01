"""The AWS account side, no node involved: before `cdk deploy` (preflight, the CDK context), the EC2 instances'
start and stop, and what is left after `cdk destroy` (the audit and its deletion)."""
