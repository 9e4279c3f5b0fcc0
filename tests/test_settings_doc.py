"""docs/reference/settings.md and the header of conf/relay.toml are rendered from
runtime/config.py: a test fails when either checked-in file differs from the rendering."""

from runtime import config, settings_doc


def test_the_checked_in_settings_reference_and_conf_header_are_current():
    stale = settings_doc.stale()
    assert not stale, (f"{', '.join(stale)} differ from runtime/config.py; regenerate with "
                       f"`{settings_doc.REGENERATE}`")


def test_the_reference_names_every_setting_its_variable_and_every_older_name():
    page = settings_doc.render_page()
    for dotted, _, _ in config.leaves():
        assert f"| `{dotted}` | `{config.env_name(dotted)}`" in page, dotted
    for var in [*config.ENV_OVERRIDES, *config.ENV_OTHER]:
        assert f"`{var}`" in page, var
    header = settings_doc.render_conf_header()
    for var in [*config.ENV_OVERRIDES, "RELAY_CONF", "RELAY_LOG_LEVEL"]:
        assert var in header, var


def test_every_setting_has_a_description_from_the_comment_above_it():
    missing = [s.dotted for s in settings_doc.settings() if not s.description]
    assert not missing
    fcm = {s.dotted: s for s in settings_doc.settings()}["push.fcm.ca_file"]
    assert "OAuth2 token endpoint" in fcm.description and fcm.allowed == "text"
