"""A `--data-source-path` class that routes each prompt to its domain's generate and reward, per sample."""

from slime.rollout.data_source import RolloutDataSourceWithBuffer

PACKAGE = "support.upstream_examples"
ROUTES = {
    "search_r1": (f"{PACKAGE}.search_r1.generate", f"{PACKAGE}.search_r1.reward"),
    "multi_agent": (f"{PACKAGE}.multi_agent.generate_with_multi_agents", f"{PACKAGE}.multi_agent.reward"),
    "retool": (f"{PACKAGE}.retool.generate", f"{PACKAGE}.retool.reward_func"),
}


class RoutedDataSource(RolloutDataSourceWithBuffer):
    def get_samples(self, num_samples):
        groups = super().get_samples(num_samples)
        for group in groups:
            for sample in group:
                sample.generate_function_path, sample.custom_rm_path = ROUTES[sample.metadata["domain"]]
        return groups
