"""The operator's Kubernetes side: resource names, the API wrapper and the kopf handlers."""
