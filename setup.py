"""Conventional build for mini-vLLM: everything is read from `settings.ini` (the nbdev 2 template)."""
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
c = cfg['DEFAULT']
reqs = c.get('requirements', '').split()
extras = {'dev': c.get('dev_requirements', '').split(), 'bundled': c.get('bundled_requirements', '').split(),
          'xgrammar': c.get('xgrammar_requirements', '').split(), 'client': c.get('client_requirements', '').split()}
extras['all'] = extras['dev'] + extras['bundled'] + extras['xgrammar'] + extras['client']
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = ['3.10', '3.11', '3.12', '3.13']
classifiers = [f"Development Status :: {statuses[int(c['status']) - 1]}", f"Intended Audience :: {c['audience']}",
               f"Natural Language :: {c['language']}"] + [f"Programming Language :: Python :: {v}" for v in py_versions]

setuptools.setup(
    name=c['lib_name'], version=c['version'], description=c['description'],
    long_description=open('README.md', encoding='utf-8').read(), long_description_content_type='text/markdown',
    author=c['author'], author_email=c['author_email'], license='Apache-2.0', url=c['git_url'],
    keywords=c['keywords'], classifiers=classifiers,  # requires-python: pyproject.toml
    project_urls={'Source': c['git_url']},
    packages=setuptools.find_packages(include=[c['lib_path'], c['lib_path'] + '.*']),
    include_package_data=True, install_requires=reqs, extras_require=extras, zip_safe=False,
    entry_points={'console_scripts': ['minivllm-serve=minivllm.server:main', 'minivllm-chat=minivllm.engine:main'],
                  'nbdev': [f"{c['lib_path']}={c['lib_path']}._modidx:d"]},
)
