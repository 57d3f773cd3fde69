"""Synthetic QA by sequential expansion (RECIPE 4.1) as a resumable pipeline of typed stages."""
